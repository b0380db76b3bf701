"""The data stream's position, world-size independent (docs/data.md): an epoch's global order,
the samples consumed from it, and the dealing of the rest to any number of processes, so a
mid-epoch resume on another process count trains every later step on the same samples."""
from .loader import ElasticDataLoader, StatefulLoaderMixin, make_stateful, report
from .order import consumed_after, deal, epoch_order, per_rank_len, rank_stream, rest_of_epoch
from .position import FORMAT, DataPosition, Verdict, keep_hint, verdict
from .sampler import ElasticSampler, GeneratorOrder, SeededOrder

__all__ = ["ElasticDataLoader", "ElasticSampler", "DataPosition", "Verdict", "verdict", "make_stateful",
           "StatefulLoaderMixin", "SeededOrder", "GeneratorOrder", "epoch_order", "per_rank_len", "rest_of_epoch",
           "deal", "rank_stream", "consumed_after", "report", "keep_hint", "FORMAT"]
