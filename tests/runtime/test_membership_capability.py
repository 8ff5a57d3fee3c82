"""The runtime offers a membership recorder to any backend that declares it records
engine membership (``RecordsEngineMembership``), by that capability, not by looking for
the fleet's module."""

from __future__ import annotations

from typing import Any

from rolloutlog.controller.backends.base import RecordsEngineMembership
from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.config import RolloutConfig
from rolloutlog.controller.engine_membership import EngineMembershipRecorder
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime
from rolloutlog.eventstore import MemoryEventStore


class _Prompts:
    fingerprint = "membership"
    num_prompts = 10

    def prompt_token_ids(self, index: int) -> list[int]:
        return [1, 2]

    def reward(self, index: int, completion_token_ids: Any) -> float:
        return 0.0


class _EnginesBackend(DeterministicBackend):
    """Not a fleet: a backend of its own whose engines come and go."""

    def __init__(self, *, accept: bool) -> None:
        super().__init__(vocab_size=16)
        self.accept = accept
        self.offered: list[Any] = []

    def adopt_membership_recorder(self, recorder: Any) -> bool:
        self.offered.append(recorder)
        return self.accept


def _controller() -> RolloutController:
    return RolloutController.start(
        MemoryEventStore(),
        "r",
        RolloutConfig(group_size=2, groups_per_step=2),
        dataset_fingerprint=_Prompts.fingerprint,
        dataset_size=_Prompts.num_prompts,
    )


def test_a_backend_with_the_capability_gets_the_recorder() -> None:
    backend = _EnginesBackend(accept=True)
    assert isinstance(backend, RecordsEngineMembership)
    ctl = _controller()
    runtime = RolloutRuntime(ctl, backend, _Prompts(), GenerationConfig(max_tokens=2))
    assert len(backend.offered) == 1
    assert isinstance(backend.offered[0], EngineMembershipRecorder)
    assert runtime.membership is backend.offered[0]
    ctl.close()


def test_a_backend_that_declines_keeps_its_listener_and_no_recorder_is_kept() -> None:
    backend = _EnginesBackend(accept=False)
    ctl = _controller()
    runtime = RolloutRuntime(ctl, backend, _Prompts(), GenerationConfig(max_tokens=2))
    assert len(backend.offered) == 1
    assert runtime.membership is None
    ctl.close()


def test_other_backends_are_offered_nothing() -> None:
    ctl = _controller()
    backend = DeterministicBackend(vocab_size=16)
    assert not isinstance(backend, RecordsEngineMembership)
    runtime = RolloutRuntime(ctl, backend, _Prompts(), GenerationConfig(max_tokens=2))
    assert runtime.membership is None
    ctl.close()
