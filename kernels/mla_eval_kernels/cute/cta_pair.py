"""The v3 "CTA pair": two 32-head CTAs of a thread-block cluster share each key tile's decode.

Inline PTX in the style of `ptx.py`, for what the DSL's pipeline does not emit with the scope the pair needs, and
`PairRing`, the K ring's full / empty mbarriers of a pair (the interface of `pipeline.PipelineAsync` that
`MlaAttentionV3` calls: producer_acquire / producer_commit / consumer_wait / consumer_release).

Why (the idea is FlashMLA's "crossover" of its sm90 decode; only the idea, read in its deep-dive docs): at h = 128 the
32-head tile decodes every record once per CTA, 4 times per query, and its producer (~5,700 cycles per 64-key tile
for fp8_ds_mla sparse) is the bound, not the consumer (~2,000-2,500). A cluster of 2 CTAs along grid y
(head tiles 2c, 2c + 1 of one query and split: the same key list and tile range) lets each CTA's producers copy and
decode half of each raw unit's keys (`tuning.v3_pair_keys`) and store every decoded bf16 K row into both
CTAs' K stage: locally with st.shared, into the peer with st.shared::cluster at the address `mapa` gives.

Synchronisation (PTX ISA sections named in brackets):
- Full barrier of K stage s in each CTA: initialised to 2 x producer threads ("mbarrier.init"). Every producer thread
  of both CTAs arrives once per tile on it: on its own CTA's after its local stores (mbarrier.arrive, .release at .cta
  scope, the default: its own consumer is in its CTA), on the peer's after its remote stores, with
  `mbarrier.arrive.release.cluster.shared::cluster` on the address `mapa` returned ("mbarrier.arrive": a remote
  arrive needs .shared::cluster and the sink `_`). Before both arrives the thread runs `fence.proxy.async.shared::cluster`
  ("Proxies", "membar / fence": the decoded rows are generic-proxy stores and wgmma reads them through the async
  proxy; .shared::cluster covers the stores into the peer, and its own CTA's window is part of it).
- The consumer waits with `mbarrier.try_wait.parity.acquire.cluster` ("mbarrier.test_wait / try_wait": the default
  .acquire.cta does not synchronise with a release by a thread of another CTA; the scope must include the peer's
  producer threads, "Memory consistency model: scope"). The stage is full only when both CTAs' producers arrived.
- Empty barrier of stage s: 2 x 128 (both consumer warpgroups). A producer overwrites stage s in both CTAs, so it must
  wait until both consumers released it: every consumer thread arrives on its own CTA's empty barrier and on the
  peer's (release.cluster, after `wgmma.wait_group` has retired its reads of the stage); the producer waits on its
  own CTA's empty barrier with acquire.cluster.
- Phases stay in step: both CTAs run the same tiles (same query, split, length / list), and neither side of a CTA can
  run a phase ahead of its peer: the peer's producer can arrive on our full barrier of stage s for tile t + 2 only
  after acquiring its empty barrier, which needs our consumer's release of tile t, which needed our full barrier of
  tile t complete (and symmetrically for the empty barriers).
- Cluster-wide barrier (`barrier.cluster.arrive` / `.wait`, release / acquire by default, "barrier.cluster") after the
  mbarrier init and its `fence.mbarrier_init.release.cluster` ("membar / fence"), before any thread arrives on or
  stores into the peer; and again before exit: a CTA must not exit while its peer can still arrive on its barriers
  (the last tiles' empty releases, which nobody waits for) or store into its shared memory ("Distributed shared
  memory": accessing an exited CTA's shared memory is undefined).
- Sparse lists: each CTA keeps computing the slot-id column of every K stage (`stage_slots`) for all 64 keys locally;
  only the decoded rows cross.

Call these only inside `@cute.jit` / `@cute.kernel` code (importing the module imports `cutlass`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32

from mla_eval_kernels.plan.tuning import V3_PAIR_CTAS

MBAR_BYTES = 8  # one mbarrier object (.b64)


def cta_rank() -> Int32:
    """This CTA's rank in its cluster (%cluster_ctarank; the pair's cluster is [1, 2, 1], so rank = block y % 2)."""
    return cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())


def mapa(addr, rank) -> Int32:
    """The shared::cluster address of shared::cta address `addr` in the CTA of cluster rank `rank` ("mapa")."""
    return cute.arch.inline_ptx(
        "mapa.shared::cluster.u32 {$w0}, {$r0}, {$r1};", write_only_types=[Int32], read_only_args=[Int32(addr), Int32(rank)]
    )


def peer_addr(addr) -> Int32:
    """The shared::cluster address of shared::cta address `addr` in the other CTA of the pair (rank 0 <-> 1)."""
    return mapa(addr, cta_rank() ^ 1)


def st_cluster_v4(addr, a, b, c, d):
    """16 bytes into (any CTA of the cluster's) shared memory at shared::cluster address `addr`."""
    cute.arch.inline_ptx(
        "st.shared::cluster.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
        read_only_args=[Int32(addr), Uint32(a), Uint32(b), Uint32(c), Uint32(d)],
    )


def fence_proxy_async_cluster():
    """Generic-proxy shared-memory writes of this thread (its CTA's and its peer's) ordered before later async-proxy
    reads (wgmma) that a release / acquire pair orders after this fence."""
    cute.arch.inline_ptx("fence.proxy.async.shared::cluster;", read_only_args=[])


def mbar_init(addr, count: int):
    cute.arch.inline_ptx(f"mbarrier.init.shared::cta.b64 [{{$r0}}], {int(count)};", read_only_args=[Int32(addr)])


def fence_mbar_init_cluster():
    """The mbarrier inits visible to the cluster's threads before the cluster barrier that follows."""
    cute.arch.inline_ptx("fence.mbarrier_init.release.cluster;", read_only_args=[])


def cluster_sync():
    """All threads of both CTAs (release / acquire at cluster scope: the defaults of barrier.cluster.arrive / wait;
    not .aligned: the roles reach it from different code)."""
    cute.arch.inline_ptx("barrier.cluster.arrive;", read_only_args=[])
    cute.arch.inline_ptx("barrier.cluster.wait;", read_only_args=[])


def mbar_arrive_local(addr):
    """Arrive on this CTA's mbarrier (release at CTA scope: what `PipelineAsync` emits for the unpaired kernel)."""
    cute.arch.inline_ptx("{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [{$r0}]; }", read_only_args=[Int32(addr)])


def mbar_arrive_remote(cluster_addr):
    """Arrive on the mbarrier at shared::cluster address `cluster_addr` (the peer's), release at cluster scope."""
    cute.arch.inline_ptx(
        "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [{$r0}];", read_only_args=[Int32(cluster_addr)]
    )


def mbar_wait_cluster(addr, phase):
    """Wait until phase `phase` (parity) of this CTA's mbarrier at `addr` completed, acquiring at cluster scope (the
    arrivals include the peer's). The labels are local to the { } block, so the wait may be inlined many times."""
    cute.arch.inline_ptx(
        "{ .reg .pred done; PAIR_WAIT: mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [{$r0}], {$r1}; "
        "@!done bra PAIR_WAIT; }",
        read_only_args=[Int32(addr), Int32(phase)],
    )


class PairRing:
    """The K ring's mbarriers of one CTA of a pair: full[s] at `base` + 8 s, empty[s] at `base` + 8 (stages + s); the
    peer's are the same objects of the other CTA, addressed by `mapa` at each remote arrive rather than carried: a
    loop-carried peer address cost the consumer the registers that made consumer rev 2's unrolled loop spill (16 B
    of stack at nvfp4 dense); a remote arrive now reads %cluster_ctarank and runs a `mapa`. The methods take a
    `pipeline.PipelineState` (index, phase), as `PipelineAsync`'s do, so the producer and consumer code is the same for
    both kernels."""

    def __init__(self, base, stages: int, producers: int, consumers: int):
        self.base = Int32(base)  # this CTA's full[0] (shared::cta address)
        self.stages = stages
        self.producers = producers  # producer threads of ONE CTA (each barrier counts both CTAs')
        self.consumers = consumers

    # carried through the kernel's run-time loops as its address (the DSL's protocol for loop values)
    def __extract_mlir_values__(self):
        return [self.base.ir_value()]

    def __new_from_mlir_values__(self, values):
        return PairRing(Int32(values[0]), self.stages, self.producers, self.consumers)

    def full(self, index):
        return self.base + MBAR_BYTES * index

    def empty(self, index):
        return self.base + MBAR_BYTES * (self.stages + index)

    @staticmethod
    def peer(addr):
        """The same mbarrier of the other CTA of the pair (shared::cluster address)."""
        return peer_addr(addr)

    @cute.jit
    def init(self, tidx: Int32):
        """One thread initialises the 2 x stages barriers, counting both CTAs' threads; then the init fence and the
        cluster barrier (every thread of both CTAs: no remote arrive or store before the peer's barriers exist)."""
        if tidx == 0:
            for s in cutlass.range_constexpr(self.stages):
                mbar_init(self.full(s), V3_PAIR_CTAS * self.producers)
                mbar_init(self.empty(s), V3_PAIR_CTAS * self.consumers)
        fence_mbar_init_cluster()
        cluster_sync()

    def producer_acquire(self, state):
        mbar_wait_cluster(self.empty(state.index), state.phase)  # both consumers released the stage

    def producer_commit(self, state):
        """After the thread's `fence_proxy_async_cluster` (the producer runs it): this CTA's full barrier, the peer's."""
        mbar_arrive_local(self.full(state.index))
        mbar_arrive_remote(self.peer(self.full(state.index)))

    def consumer_wait(self, state):
        mbar_wait_cluster(self.full(state.index), state.phase)

    def consumer_release(self, state):
        mbar_arrive_local(self.empty(state.index))
        mbar_arrive_remote(self.peer(self.empty(state.index)))
