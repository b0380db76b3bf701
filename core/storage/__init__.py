"""The only package that talks to tensorstore: spec builders (pure) and the Store (I/O)."""
from .specs import kvstore_spec, zarr_spec, context_spec, split_url
from .store import Store
from . import chunks

__all__ = ["kvstore_spec", "zarr_spec", "context_spec", "split_url", "Store"]
