"""transformers.Trainer checkpoints: the stall a save costs the training loop, stock Trainer vs
`transformers_bytecheckpoint.attach` (async and sync), on a Llama-shaped model with AdamW state;
and the JIT checkpoint on SIGTERM (`enable_jit_checkpoint`), stock vs attached (issue 27).

    python benchmarks/bench_transformers.py [--quick] [--layers 24] [--repeats 5]

Model (built from a config, no download): transformers' LlamaForCausalLM with hidden 256,
intermediate 688, 4 heads, vocab 32000 (bench_real_model.py's shapes), untied head; one training
step so AdamW has its moments: ~35M parameters at 24 layers, ~400 MiB with the optimizer state.

One process, local disk, page cache warm. Two Trainers built alike (same seed, one step each): the
stock one and an attached one. Each repeat, interleaved:
  stock        Trainer._save_checkpoint as the training loop calls it (model.safetensors,
               optimizer.pt, scheduler.pt, rng_state.pth, trainer_state.json; nothing fsynced)
  stock+fsync  the same, then every file it wrote fsynced (what a durable checkpoint costs)
  bcp async    the attached _save_checkpoint: returns once the state is copied out (the stall);
               then the time until it is committed (wait)
  bcp sync     the attached save, written, fsynced and committed before it returns
  memcpy floor a copy of the same tensors into warm preallocated buffers (what any async save's
               stall is bounded by on a CPU machine); "engine stall" is bcp's own part of the async stall
  JIT          the Trainer's JIT checkpoint (CheckpointManager.execute_jit_checkpoint, what runs
               after SIGTERM): stock (not durable), stock+fsync, attached (synchronous, committed,
               durable)
Medians over --repeats. Files: what one checkpoint folder holds (recursively); bytes: what it holds
on disk, a hard-linked file counted once (the attached folder's model.safetensors is the
checkpoint's own safetensors pack, issue 33); from_pretrained: LlamaForCausalLM.from_pretrained of
the folder, stock vs attached.

LoRA (issue 33; --lora-only runs just this part): the same Llama-shaped base with a peft LoRA
adapter (r=16 on q/k/v/o_proj), one training step; stock vs attached _save_checkpoint, each folder's
bytes on disk (stock: adapter_model.safetensors + optimizer.pt + ...; attached: the adapter and its
optimizer state in bytecheckpoint/, adapter_model.safetensors a link to its pack), the save stall
(bcp async), and sync (written, fsynced, committed). Targets: bytes <= 2x stock + 1 MiB, stall <= stock.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from figures import figure  # noqa: E402


def llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM, set_seed

    set_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=32000, max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


class Tokens:
    def __init__(self, n=8, length=32):
        import torch

        self.ids = torch.randint(0, 32000, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer(out: str, layers: int):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True, enable_jit_checkpoint=True,
                             logging_strategy="no")
    t = Trainer(model=llama(layers), args=args, train_dataset=Tokens())
    t.train()  # one step: AdamW state exists
    return t


def fsync_tree(path: str) -> None:
    for d, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        fd = os.open(d, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def count_files(path: str) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


def bytes_on_disk(path: str) -> int:
    """Bytes of every file under `path`, a hard-linked file counted once."""
    sizes = {}
    for d, _, names in os.walk(path):
        for name in names:
            st = os.stat(os.path.join(d, name))
            sizes[(st.st_dev, st.st_ino)] = st.st_size
    return sum(sizes.values())


LORA_SHAPES = {  # name -> (rank, target modules)
    "r16 attention": (16, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "r64 all linear": (64, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}


def checkpoint_folder(t) -> str:
    """The folder a Trainer's checkpoint at its current global step goes to."""
    return os.path.join(t.args.output_dir, f"checkpoint-{t.state.global_step}")


class TimedSaves:
    """save(trainer, fn): fn() at a new global step (so every save gets a folder of its own), timed."""

    def __init__(self, first_step: int = 100):
        self.step = first_step

    def __call__(self, t, fn: Callable[[], None]) -> float:
        self.step += 1
        t.state.global_step = self.step
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def lora_trainer(out: str, layers: int, shape: str = "r16 attention"):
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True, logging_strategy="no")
    rank, targets = LORA_SHAPES[shape]
    model = get_peft_model(llama(layers), LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.05,
                                                     task_type="CAUSAL_LM", target_modules=targets))
    t = Trainer(model=model, args=args, train_dataset=Tokens())
    t.train()
    return t


def lora_bench(root: str, layers: int, repeats: int, shape: str = "r16 attention") -> None:
    """Stock vs attached checkpoints of a LoRA fine-tune (the module docstring)."""
    from transformers_bytecheckpoint import attach

    tag = shape.replace(" ", "_")
    stock = lora_trainer(os.path.join(root, f"lora_stock_{tag}"), layers, shape)
    ours = lora_trainer(os.path.join(root, f"lora_bcp_{tag}"), layers, shape)
    handle = attach(ours, log_metrics=False)
    trainable = sum(p.numel() for p in ours.model.parameters() if p.requires_grad)
    base = sum(p.numel() for p in ours.model.parameters()) - trainable
    print(f"\nLoRA {shape}: base {base / 1e6:.1f}M parameters (frozen), adapter {trainable / 1e6:.2f}M trainable; "
          f"{repeats} repeats", flush=True)
    times: Dict[str, List[float]] = {k: [] for k in ("stock", "stock+fsync", "bcp async", "bcp sync")}
    size: Dict[str, int] = {}
    save, folder = TimedSaves(), checkpoint_folder

    for r in range(repeats + 1):
        got = {"stock": save(stock, lambda: stock._save_checkpoint(stock.model, None))}
        size["stock"] = bytes_on_disk(folder(stock))
        shutil.rmtree(stock.args.output_dir, ignore_errors=True)
        got["stock+fsync"] = save(stock, lambda: (stock._save_checkpoint(stock.model, None), fsync_tree(folder(stock))))
        shutil.rmtree(stock.args.output_dir, ignore_errors=True)
        handle._async = True
        got["bcp async"] = save(ours, lambda: ours._save_checkpoint(ours.model, None))
        handle.wait()
        size["bcp"] = bytes_on_disk(folder(ours))
        shutil.rmtree(ours.args.output_dir, ignore_errors=True)
        handle._async = False
        got["bcp sync"] = save(ours, lambda: ours._save_checkpoint(ours.model, None))
        shutil.rmtree(ours.args.output_dir, ignore_errors=True)
        print(f"lora round {r}{' (warm-up)' if r == 0 else ''}: " + ", ".join(f"{k} {v:.4f}" for k, v in got.items())
              + f"; bytes stock {size['stock']}, bcp {size['bcp']}", flush=True)
        if r:
            for k, v in got.items():
                times[k].append(v)
    handle.remove()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n| LoRA ({shape}) Trainer checkpoint, 1 process | seconds (median) | / stock |")
    print("|---|---:|---:|")
    for k, v in med.items():
        print(f"| {k} | {v:.4f} | {v / med['stock']:.2f} |")
    print(f"\nLoRA checkpoint folder bytes on disk: stock {size['stock'] / 2**20:.3f} MiB, bcp {size['bcp'] / 2**20:.3f} "
          f"MiB ({size['bcp'] / size['stock']:.2f}x; target <= 2x + 1 MiB = {(2 * size['stock'] + 2**20) / 2**20:.3f} MiB)")
    figure(f"LoRA ({shape}) checkpoint folder bytes on disk, bcp / stock Trainer (issue 33)", size["bcp"] / 2**20,
           size["stock"] / 2**20, f"<= {(2 * size['stock'] + 2**20) / size['stock']:.2f}", unit="MiB",
           peer_name="stock Trainer checkpoint folder", note="target: 2x stock + 1 MiB")
    figure(f"LoRA ({shape}) save stall, bcp async / stock Trainer save (issue 33)", med["bcp async"], med["stock"],
           "<= 1",
           peer_name="stock Trainer._save_checkpoint", note=f"bcp sync (durable, committed) {med['bcp sync']:.4f} s; "
                                                            f"stock + fsync {med['stock+fsync']:.4f} s")


def from_pretrained(path: str) -> float:
    from transformers import LlamaForCausalLM

    t0 = time.perf_counter()
    LlamaForCausalLM.from_pretrained(path)
    return time.perf_counter() - t0


def jit_manager(t):
    for cb in t.callback_handler.callbacks:
        if getattr(cb, "jit_manager", None) is not None:
            return cb.jit_manager
    raise SystemExit("no JIT checkpoint manager (enable_jit_checkpoint)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--lora-only", action="store_true", help="only the LoRA part (issue 33)")
    a = p.parse_args()
    quick = a.quick or os.environ.get("BCP_BENCH_QUICK") == "1"
    layers = a.layers or (8 if quick else 24)
    repeats = a.repeats or (3 if quick else 5)
    import torch

    torch.set_num_threads(1)
    from transformers_bytecheckpoint import attach

    root = tempfile.mkdtemp(prefix="bench_tr_", dir=os.environ.get("BCP_BENCH_DIR"))
    if a.lora_only:
        try:
            for shape in LORA_SHAPES:
                lora_bench(root, layers, repeats, shape)
            return None
        finally:
            shutil.rmtree(root, ignore_errors=True)
    try:
        stock = trainer(os.path.join(root, "stock"), layers)
        ours = trainer(os.path.join(root, "bcp"), layers)
        handle = attach(ours, log_metrics=False)
        nparams = sum(p.numel() for p in stock.model.parameters())
        nbytes = nparams * 4 * 3
        print(f"Llama-shaped: {layers} layers, {nparams / 1e6:.1f}M parameters, {nbytes / 2**20:.0f} MiB with AdamW "
              f"state; {repeats} repeats", flush=True)
        times: Dict[str, List[float]] = {k: [] for k in (
            "stock", "stock+fsync", "bcp async", "bcp async committed", "bcp sync",
            "JIT stock", "JIT stock+fsync", "JIT bcp", "memcpy floor", "bcp async: engine stall")}
        state = [p.detach() for p in ours.model.parameters()] + [
            v for s in ours.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        floor_bufs = [torch.empty_like(t) for t in state]  # a copy of the state into warm buffers
        files: Dict[str, int] = {}
        size: Dict[str, int] = {}
        save, folder = TimedSaves(), checkpoint_folder

        def clean(t) -> None:
            shutil.rmtree(t.args.output_dir, ignore_errors=True)

        for r in range(repeats + 1):  # round 0: warm-up, not counted
            got: Dict[str, float] = {}
            got["stock"] = save(stock, lambda: stock._save_checkpoint(stock.model, None))
            files["stock"] = count_files(folder(stock))
            size["stock"] = bytes_on_disk(folder(stock))
            if r == repeats:
                got["from_pretrained stock"] = from_pretrained(folder(stock))
            clean(stock)
            got["stock+fsync"] = save(stock, lambda: (stock._save_checkpoint(stock.model, None),
                                                      fsync_tree(folder(stock))))
            clean(stock)
            handle._async = True
            got["bcp async"] = save(ours, lambda: ours._save_checkpoint(ours.model, None))
            t0 = time.perf_counter()
            handle.wait()
            got["bcp async committed"] = got["bcp async"] + time.perf_counter() - t0
            got["bcp async: engine stall"] = handle.last_save.get("stall_s", float("nan"))
            files["bcp"] = count_files(folder(ours))
            size["bcp"] = bytes_on_disk(folder(ours))
            if r == repeats:
                got["from_pretrained bcp"] = from_pretrained(folder(ours))
            clean(ours)
            handle._async = False
            got["bcp sync"] = save(ours, lambda: ours._save_checkpoint(ours.model, None))
            clean(ours)
            got["JIT stock"] = save(stock, jit_manager(stock).execute_jit_checkpoint)
            clean(stock)
            got["JIT stock+fsync"] = save(stock, lambda: (jit_manager(stock).execute_jit_checkpoint(),
                                                          fsync_tree(folder(stock))))
            clean(stock)
            handle._async = True  # the JIT save is synchronous all the same
            got["JIT bcp"] = save(ours, jit_manager(ours).execute_jit_checkpoint)
            assert not handle.pending and ours.state.global_step == save.step
            clean(ours)
            t0 = time.perf_counter()
            for buf, t in zip(floor_bufs, state):
                buf.copy_(t)
            got["memcpy floor"] = time.perf_counter() - t0
            print(f"round {r}{' (warm-up)' if r == 0 else ''}: " + ", ".join(f"{k} {v:.3f}" for k, v in got.items()),
                  flush=True)
            if r:
                for k, v in got.items():
                    times.setdefault(k, []).append(v)
        handle.remove()
        med = {k: statistics.median(v) for k, v in times.items()}
        print("\n| Trainer checkpoint, 1 process, %.0f MiB | seconds (median) | / stock |" % (nbytes / 2**20))
        print("|---|---:|---:|")
        for k, v in med.items():
            base = med["JIT stock"] if k.startswith("JIT") else med["stock"]
            print(f"| {k} | {v:.3f} | {v / base:.2f} |")
        print(f"\nfiles per checkpoint folder: stock {files['stock']}, bcp {files['bcp']}; bytes on disk (a hard link "
              f"counted once): stock {size['stock'] / 2**20:.1f} MiB, bcp {size['bcp'] / 2**20:.1f} MiB", flush=True)
        figure("Trainer save stall, bcp async / stock Trainer save (1 process, Llama-shaped)", med["bcp async"],
               med["stock"], "<= 0.1", peer_name="stock Trainer._save_checkpoint",
               note=f"{nbytes / 2**20:.0f} MiB; files {files['bcp']} vs {files['stock']}; memcpy of the state "
                    f"{med['memcpy floor']:.3f} s = {med['memcpy floor'] / med['stock']:.2f}x stock")
        figure("Trainer save until committed, bcp async / stock Trainer save + fsync", med["bcp async committed"],
               med["stock+fsync"], "", peer_name="stock save + fsync of its files")
        figure("Trainer JIT checkpoint (SIGTERM), bcp (committed, durable) / stock + fsync", med["JIT bcp"],
               med["JIT stock+fsync"], "", peer_name="stock JIT checkpoint + fsync",
               note=f"stock JIT without fsync: {med['JIT stock']:.3f} s")
        figure("Trainer checkpoint folder bytes on disk, bcp / stock (model.safetensors a link, issue 33)",
               size["bcp"] / 2**20, size["stock"] / 2**20, "", unit="MiB", peer_name="stock checkpoint folder",
               note="bcp also keeps both names of a tied weight; this model has none")
        figure("from_pretrained(checkpoint folder), bcp / stock (issue 33)", med["from_pretrained bcp"],
               med["from_pretrained stock"], "", peer_name="stock checkpoint folder", note="one load each, last round")
        for shape in LORA_SHAPES:
            lora_bench(root, layers, repeats, shape)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
