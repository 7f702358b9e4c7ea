"""Announcing workers: the scheduler routes to them, the elastic coordinator counts them.

A worker is registered with the scheduler only once it serves, and deregistered before it is
stopped, so no turn is routed to a worker that is going away.
"""

from __future__ import annotations

import uuid

from libra import log as liblog
from libra.v1 import common_pb2, elastic_pb2, elastic_pb2_grpc, scheduler_pb2

_log = liblog.get("libra.rollout")


class Membership:
    def __init__(self, pool, router, elastic_channel, run_id: str):
        self.pool, self.router, self.run_id = pool, router, run_id
        self.elastic = elastic_pb2_grpc.ElasticCoordinatorStub(elastic_channel)

    def _meta(self) -> common_pb2.RequestMeta:
        return common_pb2.RequestMeta(request_id=uuid.uuid4().hex, run_id=self.run_id)

    async def join(self, worker) -> None:
        info = worker.to_proto()
        await self.router.register(info)
        member = elastic_pb2.Member(member_id=worker.worker_id, role=elastic_pb2.ROLE_ROLLOUT,
                                    address=info.address, bucket=worker.bucket, gpus=0)
        await self.elastic.RegisterMember(elastic_pb2.RegisterMemberRequest(meta=self._meta(), member=member),
                                          timeout=10)
        _log.info("worker joined", worker=worker.worker_id, bucket=worker.bucket, address=info.address)

    async def forget_others(self) -> list[str]:
        """Deregister workers the scheduler still knows from an earlier gateway (a restart)."""
        stats = await self.router.stub.GetStats(scheduler_pb2.GetStatsRequest(run_id=self.run_id), timeout=10)
        stale = [w.worker_id for w in stats.workers if w.worker_id not in self.pool.workers]
        for worker_id in stale:
            await self.router.deregister(worker_id)
        if stale:
            _log.info("deregistered workers of an earlier gateway", workers=stale)
        return stale

    async def leave(self, worker, reason: str) -> None:
        await self.router.deregister(worker.worker_id)
        target = elastic_pb2.MEMBER_STATE_OFFLINE
        try:
            await self.elastic.Transition(elastic_pb2.TransitionRequest(
                meta=self._meta(), member_id=worker.worker_id, target=target, detail=reason), timeout=10)
        except Exception as error:  # noqa: BLE001 - membership bookkeeping must not stop the drain
            _log.warning("elastic transition failed", worker=worker.worker_id, error=str(error))
        _log.info("worker left", worker=worker.worker_id, reason=reason)
