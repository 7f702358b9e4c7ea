"""The data plane of the elastic hybrid pool: hybrid replicas that train next to the core group.

A *hybrid replica* is a whole data-parallel replica borrowed from rollout. It never joins the core
process group: it talks to the core over a side channel (one TCP endpoint per core rank, i.e. per
model-parallel lane of each core data-parallel rank), so membership changes never create, destroy
or use the core's process group (ARCHITECTURE.md §7). Its gradients may go over a private
two-rank group of its own (see "Gradient channel" below), created and destroyed with the hybrid.

Contract for the control plane (services/elastic drives this; nothing here imports it)
--------------------------------------------------------------------------------------
RPCs of the trainer (protos/libra/v1/trainer.proto); each returns at once, and what it asks for
takes effect at the next step boundary. Membership is kept in Redis (blob `trainer.membership`),
so a restarted trainer knows it.

* ``AdmitHybrid(meta, replica_id, generation)`` → Ack(applied). Registers the replica as JOINING
  and assigns it to the core data-parallel rank with the fewest hybrids (lowest rank on ties).
  applied=False if the replica is already admitted with this generation; a repeated request id
  answers the first reply (docs/rpc.md). A replica admitted again after FAILED/RELEASED starts a
  fresh join.
* ``ReleaseHybrid(meta, replica_id, generation)`` → Ack(applied). The replica leaves at the next
  step boundary (it is absent from that step's manifest), is told BYE and exits 0. NOT_FOUND for
  an unknown replica; applied=False if it already left or failed.
* ``GetStepManifest(run_id, step)`` → StepManifest. ``step=0``: the manifest of the latest
  frozen step (or, before the first step, the membership as it stands). ``step=N``: the frozen
  manifest of step N (the last 64 are kept; older → NOT_FOUND). Fields: step, membership_epoch
  (bumped whenever the active set changes), active_replicas (core ranks "core-<r>" first, then
  active hybrid ids), acknowledged_by (who acknowledged that step: core ranks, and each hybrid whose
  gradient arrived), ``hybrids`` (every known hybrid: state, dp_rank, endpoint, reason when
  FAILED) and ``lane_endpoints`` (index = core data-parallel rank, value HOST:PORT).

Before the first boundary after AdmitHybrid, GetStepManifest(step=0) already lists the replica as
JOINING with its endpoint when the core has one data-parallel rank (with several, the rank is
assigned at that boundary).

States of a hybrid (HybridState): JOINING (admitted; its process connects, is told the core's
backend kind, model directory, config and flat-gradient layout, builds model and optimizer of that
kind and reports ``prepared``) → SNAPSHOT (at the next
boundary the core copies its state and writes shards in a thread while it keeps stepping; the
hybrid loads them, then replays the gradients of the steps since, streamed to it as they happen)
→ ACTIVE (at most one step behind at a boundary: it trains in every manifest from
``active_from_step``) → RELEASED. Any failure — the process does not connect and build its model
within ``join_timeout_s`` (120 s; these limits are ``trainer.elastic`` settings), more than
``max_catch_up_steps`` (64) steps pass before it
loads the snapshot, the snapshot write or fetch fails, the hybrid misses a step's gradient deadline (``grad_deadline_s``, 60 s), or
its connection drops — makes it FAILED with a ``reason``, rolls the whole replica back (snapshot
files and retained gradients dropped, never again in a manifest) and the core carries on. The
coordinator may re-admit it with a new generation.

Starting a hybrid process
-------------------------
    python -m libra.services.trainer.elastic.hybrid --trainer HOST:PORT --run-id RUN \
        --replica-id ID [--threads N] [--device cpu|cuda]
    # or, without the RPC lookup:  --endpoint HOST:PORT (the lane endpoint of its core rank)

Start it after AdmitHybrid (it looks its endpoint up in GetStepManifest(step=0).hybrids, retrying
for up to 60 s). It needs nothing else: the backend kind, the model directory, the trainer config
and the snapshot path arrive over the side channel.

Backends (``backends``). A hybrid builds the core's backend with the core's config: the torch
backend, or, with ``trainer.backend: megatron``, a MegatronBackend with TP = PP = 1 in a
one-process torch.distributed world of its own (never the core's, whatever RANK / MASTER_ADDR its
environment holds) and the distributed optimizer off. Its flat gradient must be laid out as its core
rank's (every parameter's gradient in order on CPU; Megatron DDP's unpadded grad buffer on GPUs):
the core sends its layout in ``prepare`` and the hybrid fails the join, with the difference as the
reason, if its own differs. A Megatron core refuses a hook (FailedPrecondition) with
``trainer.backend.tensor_parallel`` > 1 or ``pipeline_parallel`` > 1 (a lane would have to map to
TP/PP coordinates, not built), and on GPUs with ``distributed_optimizer`` on. Megatron snapshots hold
the model's tensors and, per parameter, Adam's moments and the fp32 master, copied on the device at
the boundary and written in the same background thread as the torch backend's. Exit codes: 0 released; 2 bad arguments; 3 join refused or
rolled back (not admitted, pair group not opened, snapshot fetch failed, catch-up failed); 4 lost
the core (connection closed, or marked failed after a missed deadline).

Gradient channel (``trainer.elastic.channel``: auto | tcp | group; ElasticCore(channel=…))
--------------------------------------------------------------------------------------------
Control frames always go over TCP. The bulk tensors — the hybrid's gradient, the reduced gradient
back, the catch-up gradients — go either inside the TCP frames (``tcp``: staged through pinned
host memory on GPUs, about 1 GB/s; every active step ships the fp32 gradient both ways, see
docs/benchmarks.md, "Elastic hybrid join") or over a *pair group* (``group``): when the hybrid
says hello, its core rank hosts a TCPStore on a free port, tells the hybrid (a ``channel`` frame)
and both build a standalone two-rank ProcessGroupNCCL (both on GPUs: device to device, NVLink on
one host) or ProcessGroupGloo (otherwise), never through ``init_process_group``. ``auto`` is the
group on two GPUs, TCP otherwise (on CPU the group is gloo over loopback TCP: no faster, so TCP;
``group`` forces it, which the CPU tests do). Every pair-group transfer has the gradient deadline
(``grad_deadline_s``) and never makes the core's CUDA stream wait for the hybrid; a hybrid that
dies or freezes mid-transfer is dropped like one that misses its deadline, and its pair group is
aborted (NCCL groups are built with TORCH_NCCL_ASYNC_ERROR_HANDLING=2, so a peer's death aborts
the communicator and never the core process). The pair group goes when the hybrid leaves, fails
or dies; a re-admitted hybrid builds a new one.

Modules: ``manifest`` (pure membership state machine and the frozen per-step manifest),
``side_channel`` (the core's lane endpoint and links, the hybrid's client), ``frames`` (the
wire format), ``device_channel`` (the channel choice and the pair group),
``snapshot`` (asynchronous sharded snapshot of model + optimizer), ``backends`` (which backend a
hybrid builds, the gradient layout, a backend's state as snapshot tensors), ``core_hooks`` (the gradient
injector the training backends call between backward and the data-parallel all-reduce),
``checks`` (a hybrid's gradient frame and the lockstep hash), ``hybrid`` (the hybrid replica
process), ``work`` (widened batches: whole groups per replica, and a slice on the wire),
``control`` (the trainer service's RPC semantics and Redis persistence).
"""
