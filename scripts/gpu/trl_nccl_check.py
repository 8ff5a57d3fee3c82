#!/usr/bin/env python
"""The TRL NCCL weight path, end to end, on a machine with two CUDA GPUs and vLLM.

What it does (see docs/integrations/trl.md, "GPU: the NCCL weight path"):

1. starts one vLLM server on ``--engine-gpu`` (``VLLM_SERVER_DEV_MODE=1``,
   ``--weight-transfer-config '{"backend":"nccl"}'``), in its own process group;
2. loads the same model as the trainer's policy on ``--trainer-gpu`` and opens TRL's
   NCCL transfer to the server (``trl.experimental.async_grpo.weight_transfer.
   WeightTransferClient``) through rolloutlog's :class:`NcclWeightTransfer`, whose
   worker (:class:`RolloutlogWorker`, SQLite log in ``--workdir``) generates on that
   server (``nccl_vllm_backend``);
3. trains one "step" (records the first group as trained), changes the policy's weights
   (seeded noise), and syncs them as TRL's trainer does: ``pause``, ``send_weights``
   (NCCL), ``resume``, ``update_model_version``;
4. checks that the engine serves the new weights: its prompt logprobs of a fixed text
   (``prompt_logprobs``) match the trainer's own (a forward pass of the changed policy)
   and differ from those before the sync; that the log records the publish of weight
   version 1; and that generation goes on at that version.

Prints one line per check and ``PASS``; exits 0 only if every check passed, 1 if one
failed, 2 if this machine cannot run it (one line saying why: no CUDA, one GPU, no vLLM
or TRL). Nothing it starts survives it (the engine's process group is killed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

PROG = "trl_nccl_check"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (argparse exits 2 with one line on a bad one)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="rolloutlog's TRL worker with TRL's NCCL weight transfer to a vLLM "
        "server: the engine serves the trainer's new weights and the log records them.",
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="model folder (default: the tiny test model)"
    )
    parser.add_argument("--trainer-gpu", type=int, default=0, help="CUDA device of the trainer")
    parser.add_argument("--engine-gpu", type=int, default=1, help="CUDA device of the vLLM server")
    parser.add_argument("--port", type=int, default=0, help="server port (0: a free one)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument(
        "--tolerance", type=float, default=2e-2, help="largest logprob gap trainer/engine"
    )
    parser.add_argument("--timeout-s", type=float, default=900.0, help="deadline of every wait")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="log, model, engine log (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    if args.trainer_gpu == args.engine_gpu:
        parser.error(
            "--trainer-gpu and --engine-gpu must differ: NCCL refuses two ranks on one device"
        )
    if min(args.trainer_gpu, args.engine_gpu) < 0 or not 0 <= args.port < 65536:
        parser.error("GPU indices must be >= 0 and --port in 0..65535")
    if not args.timeout_s > 0 or not args.tolerance > 0:
        parser.error("--timeout-s and --tolerance must be > 0")
    return args


def refusal(args: argparse.Namespace) -> str | None:
    """Why this machine cannot run the check (one line), or None."""
    try:
        import torch
    except ImportError as exc:
        return f"{PROG}: needs torch ({exc})"
    if not torch.cuda.is_available():
        return (
            f"{PROG}: needs CUDA GPUs, and torch.cuda.is_available() is False on this machine: "
            "run it on a machine with two CUDA GPUs and vLLM"
        )
    count = torch.cuda.device_count()
    if max(args.trainer_gpu, args.engine_gpu) >= count:
        return (
            f"{PROG}: needs two CUDA GPUs (trainer {args.trainer_gpu}, engine {args.engine_gpu}; "
            f"NCCL refuses two ranks on one device), this machine has {count}"
        )
    for module, what in (
        ("vllm", "vLLM (pip install vllm)"),
        ("trl", "TRL >= 1.16 (pip install trl)"),
    ):
        try:
            __import__(module)
        except ImportError as exc:
            return f"{PROG}: needs {what}: {exc}"
    try:
        from trl.experimental.async_grpo.weight_transfer import WeightTransferClient  # noqa: F401
    except ImportError as exc:
        return f"{PROG}: this TRL has no NCCL weight transfer (trl.experimental.async_grpo): {exc}"
    return None


class Check:
    """The checks' outcomes, printed as they come."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def __call__(self, ok: bool, what: str) -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
        if not ok:
            self.failed.append(what)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def start_engine(
    args: argparse.Namespace, model: Path, port: int, log_path: Path
) -> subprocess.Popen[bytes]:
    """The vLLM server on ``--engine-gpu`` with the NCCL weight transfer, own process group."""
    env = dict(os.environ)
    env.update(
        {
            "CUDA_VISIBLE_DEVICES": str(args.engine_gpu),
            "VLLM_SERVER_DEV_MODE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
    )
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model.resolve()), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--seed", "0",
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--weight-transfer-config", json.dumps({"backend": "nccl"}),
    ]  # fmt: skip
    log = open(log_path, "wb")  # noqa: SIM115 - the child writes it until it ends
    try:
        return subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    finally:
        log.close()


def stop_engine(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM the engine's process group, SIGKILL it after ``grace_s``, reap."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(grace_s)


def trainer_logprobs(model: Any, prompt: list[int]) -> list[float]:
    """The policy's logprob of each prompt token after the first (as ``prompt_logprobs``)."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt], device=next(model.parameters()).device)
        logits = model(ids).logits.float()
        logp = torch.log_softmax(logits[0, :-1], dim=-1)
        return [float(x) for x in logp.gather(1, ids[0, 1:, None])[:, 0].cpu()]


def engine_logprobs(url: str, model_dir: Path, prompt: list[int], timeout_s: float) -> list[float]:
    """The engine's ``prompt_logprobs`` of ``prompt`` (a probe client of its own)."""
    from rolloutlog.controller.backends.vllm_server import VLLMServerBackend

    async def probe() -> list[float]:
        backend = VLLMServerBackend(url, model_dir=model_dir, control_timeout=timeout_s)
        await backend.start()
        try:
            return await backend.prompt_logprobs(tuple(prompt))
        finally:
            await backend.close()

    return asyncio.run(probe())


def _gap(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        return math.inf
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=math.inf)


def _next_sample(worker: Any, deadline: float) -> Any:
    import queue

    while time.monotonic() < deadline:
        worker.check_health(stale_after_s=deadline - time.monotonic() + 1)
        try:
            return worker.rollout_buffer.get(timeout=0.5)
        except queue.Empty:
            continue
    raise TimeoutError("no sample from the worker before the deadline")


def run(args: argparse.Namespace) -> int:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.async_grpo.vllm_client import VLLMClient
    from trl.experimental.async_grpo.weight_transfer import WeightTransferClient

    from rolloutlog.controller.domain import CODEC
    from rolloutlog.controller.rollout_index import read_where
    from rolloutlog.eventstore import EventStore
    from rolloutlog.grpo.tiny_model import build_tiny_model
    from rolloutlog.integrations.trl import NcclWeightTransfer, RolloutlogWorker, nccl_vllm_backend

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rolloutlog-nccl-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = args.model or build_tiny_model(workdir / "model")
    port = args.port or _free_port()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.timeout_s
    check = Check()
    print(
        f"workdir {workdir}; engine {url} on GPU {args.engine_gpu}, "
        f"trainer on GPU {args.trainer_gpu}"
    )
    engine = start_engine(args, model_dir, port, workdir / "engine.log")
    worker = transfer = None
    try:
        while not _healthy(url):
            if engine.poll() is not None or time.monotonic() > deadline:
                tail = (workdir / "engine.log").read_text(errors="replace").splitlines()[-20:]
                print("\n".join(tail), file=sys.stderr)
                check(False, f"the vLLM server answers /health (log: {workdir / 'engine.log'})")
                return 1
            time.sleep(1)
        check(True, "the vLLM server answers /health")

        torch.cuda.set_device(args.trainer_gpu)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        policy = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        policy.cuda(args.trainer_gpu).eval()
        params = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
        client = WeightTransferClient(
            VLLMClient(url, args.timeout_s),
            weight_update_info={
                "names": [n for n, _ in params],
                "dtype_names": [str(p.dtype).split(".")[-1] for _, p in params],
                "shapes": [list(p.shape) for _, p in params],
            },
            weight_sync_timeout=int(args.timeout_s),
        )
        dataset = Dataset.from_dict({"prompt": [f"q: {i}+{i % 7}=? a:" for i in range(16)]})
        worker = RolloutlogWorker(
            store=f"sqlite:///{(workdir / 'rolloutlog.db').resolve()}",
            train_dataset=dataset,
            processing_class=tokenizer,
            reward_funcs=lambda completion_ids, **_: [len(c) / 8.0 for c in completion_ids],
            backend=nccl_vllm_backend(url, model_dir=model_dir, max_model_len=256),
            num_generations=2,
            groups_per_step=1,
            max_staleness=1,
            timeout_s=args.timeout_s,
        )
        transfer = NcclWeightTransfer(worker, client)
        transfer.init_weight_transfer()
        check(True, "TRL's NCCL group with the server is open (NcclWeightTransfer)")
        worker.start()
        first = _next_sample(worker, deadline)
        check(
            first.model_version == 0,
            f"the first sample is of weight version 0 ({first.model_version})",
        )

        prompt = list(tokenizer("the quick brown fox jumps over the lazy dog")["input_ids"])
        before = engine_logprobs(url, model_dir, prompt, args.timeout_s)
        check(
            _gap(before, trainer_logprobs(policy, prompt)) < args.tolerance,
            "before the sync the engine's prompt logprobs match the trainer's",
        )

        # One optimizer step: the first group trained, the policy's weights changed.
        samples = [first] + [_next_sample(worker, deadline) for _ in range(1)]
        worker.record_trained([s.group_id for s in samples])
        generator = torch.Generator(device=f"cuda:{args.trainer_gpu}").manual_seed(0)
        with torch.no_grad():
            for _, p in params:
                p.add_(0.05 * torch.randn(p.shape, generator=generator, device=p.device))
        expected = trainer_logprobs(policy, prompt)

        # TRL's _sync_weight_merged, in its order.
        transfer.pause()
        transfer.send_weights((n, p.detach()) for n, p in params)
        transfer.resume()
        worker.update_model_version(1)

        after = engine_logprobs(url, model_dir, prompt, args.timeout_s)
        gap, moved = _gap(after, expected), _gap(after, before)
        check(
            gap < args.tolerance,
            f"after the sync the engine serves the new weights (gap {gap:.2e})",
        )
        check(
            moved > 10 * args.tolerance,
            f"the engine's logprobs moved with the weights ({moved:.2e})",
        )
        assert worker.controller is not None
        state = worker.controller.state
        check(
            state.published_version == 1,
            f"the log's published version is 1 ({state.published_version})",
        )
        while True:
            sample = _next_sample(worker, deadline)
            if sample.model_version >= 1:
                break
        check(
            sample.model_version == 1,
            f"generation goes on at weight version 1 ({sample.model_version})",
        )
        run_id = worker.run_id or ""
    finally:
        try:
            if worker is not None:
                worker.stop()
            if transfer is not None:
                transfer.destroy()
        finally:
            stop_engine(engine)
    store = EventStore.open(f"sqlite:///{(workdir / 'rolloutlog.db').resolve()}")
    try:
        published = [
            CODEC.decode(r).weight_version  # type: ignore[attr-defined]
            for r in read_where(store, run_id, event_type="WeightsPublished")
        ]
    finally:
        store.close()
    check(published[-1:] == [1], f"the log records the publish of weight version 1 ({published})")
    print("FAIL: " + "; ".join(check.failed) if check.failed else "PASS", flush=True)
    return 1 if check.failed else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = refusal(args)
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
