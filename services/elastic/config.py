"""Typed config of the elastic coordinator: heartbeats, phase deadlines and how hybrids start."""

from __future__ import annotations

from pydantic import Field, field_validator

from libra.configbase import Section

HYBRID_PLACEHOLDERS = ("{python}", "{trainer}", "{run_id}", "{replica_id}", "{generation}")
# How services/trainer/elastic documents starting one hybrid replica (after AdmitHybrid).
DEFAULT_HYBRID_COMMAND = ("{python}", "-m", "libra.services.trainer.elastic.hybrid", "--trainer", "{trainer}",
                          "--run-id", "{run_id}", "--replica-id", "{replica_id}")


class PhaseDeadlines(Section):
    """Seconds each phase of a hybrid replica may take; past it the replica is rolled back."""

    drain_s: float = Field(120.0, gt=0, le=86_400,
                           description="a rollout worker's drain (in-flight turns finish) before a join")
    joining_s: float = Field(60.0, gt=0, le=86_400,
                             description="JOINING: the trainer admits the replica and its process starts")
    fetching_state_s: float = Field(600.0, gt=0, le=86_400,
                                    description="FETCHING_STATE: the snapshot of model and optimizer arrives")
    aligned_s: float = Field(600.0, gt=0, le=86_400,
                             description="ALIGNED: the replica enters a step manifest (a step boundary)")
    releasing_s: float = Field(600.0, gt=0, le=86_400,
                               description="RELEASING: the trainer lets it go at a step boundary")
    exit_grace_s: float = Field(10.0, ge=0, le=3600,
                                description="a released hybrid process may take this long to exit by itself "
                                            "before it is stopped")
    rollback_s: float = Field(120.0, gt=0, le=86_400,
                              description="undoing a failed replica (release, stop, restart its workers)")
    start_workers_s: float = Field(600.0, gt=0, le=86_400,
                                   description="rollout workers started after a release become ready")


class ElasticConfig(Section):
    """Membership registry and the hybrid-pool state machine."""

    heartbeat_timeout_s: float = Field(30.0, gt=0, le=3600,
                                       description="a member with no heartbeat for this long is marked offline")
    core_replicas: int = Field(1, ge=1, le=65536,
                               description="data-parallel replicas of the core trainer; a plan's training.dp "
                                           "above this many is met by hybrid replicas")
    deadlines: PhaseDeadlines = Field(default_factory=PhaseDeadlines, description="per-phase deadlines")
    poll_interval_s: float = Field(0.5, gt=0, le=60,
                                   description="how often a replica task polls the trainer and its process")
    history_per_replica: int = Field(200, ge=4, le=100_000,
                                     description="transitions kept in each replica record (oldest dropped)")
    hybrid_command: tuple[str, ...] = Field(
        DEFAULT_HYBRID_COMMAND,
        description="argv that starts one hybrid process on this host after AdmitHybrid; placeholders "
                    + ", ".join(HYBRID_PLACEHOLDERS) + "; empty: something else (a cluster scheduler) starts "
                    "them and the coordinator follows them through the trainer only")

    @field_validator("hybrid_command")
    @classmethod
    def _placeholders(cls, argv: tuple[str, ...]) -> tuple[str, ...]:
        for arg in argv:
            try:
                arg.format(**{p.strip("{}"): "" for p in HYBRID_PLACEHOLDERS})
            except (KeyError, IndexError, ValueError) as error:
                raise ValueError(f"elastic.hybrid_command: {arg!r} uses an unknown placeholder ({error}); "
                                 f"use only {', '.join(HYBRID_PLACEHOLDERS)}") from error
        return argv
