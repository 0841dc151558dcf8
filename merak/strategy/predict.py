"""Predict one candidate layout's step time and per-rank peak memory.

Time: the schedule's programs are replayed by the simulator (`merak.schedule.simulator`) with
per-rank forward, backward, recomputation and point-to-point times built from `BlockCosts`
(blocks divided evenly over the stages, the LM head on the last), then the step's tail: the
data-parallel gradient sum, of which only what outlasts the rank's last backward shows (the
buckets start during it), ZeRO-3's parameter gathers, and the optimizer step.

Memory: model states (fp32 weights, fp32 gradients, Adam's two fp32 moments, divided as the
ZeRO stage divides them in Merak's implementation) plus the activation peak the simulator's
memory replay gives for the schedule, with each stage's recomputed blocks keeping only their
inputs. ``recompute="budget"`` recomputes the fewest blocks that keep every rank within the
memory limit.

Context parallelism (cp > 1): a rank computes and keeps 1/cp of each micro-batch's tokens
(blocks, head, pipeline messages; attention's work is balanced by the load-balanced split), its
blocks add the cp exchange (`context_parallel_s`), and the gradients of its weights are reduced
over dp x cp (ZeRO shards over them too).
"""

from __future__ import annotations

from dataclasses import replace

from merak.recompute.stage_aware import KeptBytes
from merak.schedule.registry import make_schedule, placement_of
from merak.schedule.simulator import CostModel, MemoryModel, simulate
from merak.strategy.candidate import BLOCK, RECOMPUTE_CHOICES, Candidate, Prediction
from merak.strategy.cluster import Cluster
from merak.strategy.costs import BlockCosts, stage_blocks, state_bytes
from merak.strategy.reference import ReferenceCosts
from merak.strategy.shape import ModelShape

EXACT_ROUNDS = 2  # schedules of up to this many rounds of pp micro-batches are replayed whole


class Predictor:
    """Predicts candidates of one model on one cluster (the global batch and sequence length
    are those the block costs and the candidates' micro-batching were made for).

    Args:
        shape: the model's sizes.
        costs: micro-batch size -> `BlockCosts` at that size (tp = 1).
        cluster: devices and links.
        memory_bytes: the per-rank limit (default the cluster's).
        parallel_vocab: the embedding and LM head are split over the TP ranks (Merak's
            ``parallel_vocab``); otherwise every TP rank holds and runs them whole.
        imbalance: under expert parallelism, the busiest rank's routed pairs over the mean
            (1: an even routing); the other ranks wait for it in every MoE block.
        reference: a preference trainer's reference forwards (`ReferenceCosts`: where they
            run, `merak.schedule.reference`); default none.
    """

    def __init__(self, shape: ModelShape, costs: dict[int, BlockCosts], cluster: Cluster,
                 memory_bytes: float | None = None, parallel_vocab: bool = False,
                 imbalance: float = 1.0, reference: ReferenceCosts | None = None):
        self.shape, self.costs, self.cluster = shape, costs, cluster
        self.reference = reference or ReferenceCosts()
        self.imbalance = imbalance
        self.memory_bytes = memory_bytes or cluster.memory_bytes
        self.parallel_vocab = parallel_vocab
        self._cache: dict[tuple, tuple[float, list[float]]] = {}
        self._schedules: dict[tuple, object] = {}

    # -- per stage ----------------------------------------------------------------------------
    def _stage_params(self, c: Candidate) -> list[float]:
        shape, stages = self.shape, c.pp * c.chunks
        counts = stage_blocks(shape.layers, stages)
        params = [n * self._block_params(c) for n in counts]
        vocab_tp = c.tp if self.parallel_vocab else 1
        params[0] += shape.embedding_params / vocab_tp
        head = shape.head_params - shape.hidden  # the final norm stays whole
        params[-1] += shape.hidden + (head + (shape.embedding_params if shape.tied and stages > 1
                                              else 0)) / vocab_tp
        return params

    def _block_params(self, c: Candidate) -> float:
        """One block's parameters on a rank: tp splits all of them; ep > 1 splits the routed
        experts further (`_block_experts`)."""
        shape = self.shape
        if c.ep == 1:
            return shape.block_params / c.tp
        return shape.block_params_outside_experts / c.tp + self._block_experts(c)

    def _block_experts(self, c: Candidate) -> float:
        """One block's routed-expert parameters on a rank under ep > 1 (reduced and, under
        ZeRO-1, sharded over their own replicas): 1/ep of the experts, each split over tp
        along its intermediate dim as the family's plan (``moe_tp_experts``) splits them; 0 at
        ep = 1, where they are ordinary."""
        return 0.0 if c.ep == 1 else self.shape.expert_params / (c.ep * c.tp)

    def expert_parallel_s(self, c: Candidate, cost: BlockCosts) -> float:
        """Seconds one block adds per pass (forward or backward) for the token exchange under
        ep > 1: the pairs out to their experts' ranks and the results back, two all-to-alls
        whose traffic is the ``(ep - 1) / ep`` of the pairs bound elsewhere; with the expert
        compute of the busiest rank above the mean by `imbalance` (the ranks wait for it)."""
        if c.ep == 1:
            return 0.0
        shape, cl = self.shape, self.cluster
        pairs = shape.exchange_bytes(cost.rows, cost.seq, cost.dtype_bytes)
        waiting = (self.imbalance - 1.0) * shape.expert_share(cost.rows, cost.seq) \
            * cost.forward_s
        return 2 * cl.all_gather_s(pairs, c.ep, c.tp) + waiting

    def _rank_cost(self, c: Candidate, cost: BlockCosts) -> BlockCosts:
        """What one cp rank computes and keeps of a micro-batch: 1/cp of its tokens."""
        if c.cp == 1:
            return cost
        return replace(cost, seq=cost.seq // c.cp, forward_s=cost.forward_s / c.cp,
                       backward_s=cost.backward_s / c.cp,
                       activation_bytes=cost.activation_bytes / c.cp,
                       boundary_bytes=cost.boundary_bytes / c.cp,
                       head_forward_s=cost.head_forward_s / c.cp,
                       head_backward_s=cost.head_backward_s / c.cp,
                       head_activation_bytes=cost.head_activation_bytes / c.cp)

    def context_parallel_s(self, c: Candidate, cost: BlockCosts) -> tuple[float, float]:
        """(forward, backward) seconds one block adds for the cp exchange, `cost` being the
        rank's share. Ulysses: all-to-alls of q, k, v and the output (backward: of their
        gradients), not overlapped. Ring: ``cp - 1`` passes of the rank's K/V block (backward:
        the K/V again and their gradients, ``cp`` passes), overlapped with the attention
        computed meanwhile (at least a tenth of the traffic shows)."""
        if c.cp == 1:
            return 0.0, 0.0
        shape, cl = self.shape, self.cluster
        tokens = cost.rows * cost.seq
        q = tokens * shape.hidden / c.tp * cost.dtype_bytes
        kv = 2 * tokens * shape.kv_heads * shape.head_dim / c.tp * cost.dtype_bytes
        if c.cp_mode == "ulysses":
            once = cl.all_gather_s(2 * q + kv, c.cp, c.tp)  # (an all-to-all's traffic)
            return once, once
        whole = cost.seq * c.cp  # the row's tokens: attention's share of a block's FLOPs
        share = 4 * cost.rows * whole * whole * shape.hidden / shape.block_flops(cost.rows, whole)
        attention = share * cost.forward_s / c.tp
        forward = (c.cp - 1) * cl.p2p_s(kv, c.cp, c.tp)
        backward = (c.cp - 1) * cl.p2p_s(kv, c.cp, c.tp) + c.cp * cl.p2p_s(2 * kv, c.cp, c.tp)
        return (max(forward - attention, 0.1 * forward),
                max(backward - 2 * attention, 0.1 * backward))

    def _times(self, c: Candidate, cost: BlockCosts, counts: list[int], recomputed: list[int]
               ) -> CostModel:
        """Per-rank durations (a rank's stages summed; the simulator gives each 1/v)."""
        cl, tp = self.cluster, c.tp
        # each block's exchanges over the cp and ep groups
        exchange = self.expert_parallel_s(c, cost)
        comm_forward, comm_backward = (s + exchange for s in self.context_parallel_s(c, cost))
        message = cost.boundary_bytes
        if c.sequence_parallel:
            # an all-gather and a reduce-scatter in place of each all-reduce; the model's
            # first block scatters its input (backward: an all-gather), its last gathers its
            # output; the pipeline carries sequence shards
            tp_comm = 4 * cl.all_gather_s(message, tp, 1)
            ends, message = cl.all_gather_s(message, tp, 1), message / tp
        else:
            tp_comm = 2 * cl.all_reduce_s(message, tp, 1)  # two all-reduces per block and pass
            ends = 0.0
        forward, backward, recompute = [0.0] * c.pp, [0.0] * c.pp, [0.0] * c.pp
        stages = len(counts)
        placement = placement_of(c.schedule, c.pp, c.chunks)
        for s, n in enumerate(counts):
            rank = placement[s]
            forward[rank] += n * (cost.forward_s / tp + tp_comm + comm_forward)
            backward[rank] += n * (cost.backward_s / tp + tp_comm + comm_backward)
            if s == 0:
                backward[rank] += ends
            rerun = recomputed[s] * (cost.forward_s / tp + tp_comm + comm_forward)
            if c.recompute == BLOCK:  # inside the backward; the recompute action is empty
                backward[rank] += rerun
                recompute[rank] += 1e-9
            else:
                recompute[rank] += rerun
            if s == stages - 1:
                vocab_tp = tp if self.parallel_vocab else 1
                forward[rank] += ends + cost.head_forward_s / vocab_tp
                backward[rank] += cost.head_backward_s / vocab_tp
        p2p = cl.p2p_s(message, c.pp, c.replicas * c.tp)
        # the simulator charges each stage of a rank 1/v of the rank's figure
        # a reference forward runs the stage's blocks and head as the forward does
        return CostModel(forward=forward, backward=backward, p2p=p2p,
                         recompute=[r if r > 0 else f for r, f in zip(recompute, forward)],
                         weight_grad=[b / 2 for b in backward], reference=tuple(forward))

    def _kept(self, c: Candidate, cost: BlockCosts, counts: list[int]) -> list[KeptBytes]:
        """Per stage, what one micro-batch's forward keeps with k blocks recomputed (under
        sequence parallelism a recomputed block keeps its input's sequence shard)."""
        shape, tp, sp = self.shape, c.tp, c.sequence_parallel
        block = cost.activation_bytes * shape.block_activation_bytes(
            cost.rows, cost.seq, tp, cost.dtype_bytes, sp) / shape.block_activation_bytes(
            cost.rows, cost.seq, 1, cost.dtype_bytes)
        boundary = cost.boundary_bytes / tp if sp else cost.boundary_bytes
        head = cost.head_activation_bytes
        kept = []
        for s, n in enumerate(counts):
            extra = head if s == len(counts) - 1 else 0.0
            kept.append(KeptBytes(tuple(int((n - k) * block + k * boundary + extra)
                                        for k in range(n + 1))))
        return kept

    # -- one candidate ------------------------------------------------------------------------
    def predict(self, c: Candidate) -> Prediction:
        result = Prediction(c)
        cost = self.costs.get(c.micro_batch)
        if cost is None:
            result.error = f"no block costs for micro-batch size {c.micro_batch}"
            return result
        cost = self._rank_cost(c, cost)
        stages = c.pp * c.chunks
        counts = stage_blocks(self.shape.layers, stages)
        if min(counts) < 1:
            result.error = f"{self.shape.layers} blocks cannot fill {stages} stages"
            return result
        params = self._stage_params(c)
        largest = self._block_params(c)
        states = [0.0] * c.pp
        placement = placement_of(c.schedule, c.pp, c.chunks)
        for s, p in enumerate(params):
            # experts' ZeRO shards are over their own replicas (dp x cp / ep)
            experts = counts[s] * self._block_experts(c)
            states[placement[s]] += state_bytes(p - experts, c.zero, c.replicas, largest) \
                + state_bytes(experts, c.zero, c.replicas // c.ep, largest)
        replica = self.reference.replica_bytes(params, placement, c.pp,
                                               c.replicas if c.zero >= 2 else 1)
        states = [a + b for a, b in zip(states, replica)]
        if max(states) > self.memory_bytes:  # no activation can fit: nothing to replay
            rank = states.index(max(states))
            result.peak_bytes = max(states)
            result.error = (f"pipeline rank {rank}'s model states alone need "
                            f"{max(states) / 2**30:.2f} GiB, over "
                            f"{self.memory_bytes / 2**30:.2f} GiB")
            return result
        kept = self._kept(c, cost, counts)
        try:
            recomputed = self._recomputed(c, cost, kept, counts, states)
            makespan, activations = self._simulate(c, cost, kept, counts, recomputed)
        except ValueError as error:
            result.error = str(error)
            return result
        result.recompute_ratios = [r / n for r, n in zip(recomputed, counts)]
        result.state_bytes, result.activation_bytes = states, activations
        peaks = [a + b for a, b in zip(states, activations)]
        result.peak_bytes = max(peaks)
        result.pipeline_s = makespan
        result.tail_s = self._tail(c, params, cost, counts)
        if self.reference.mode == "before":  # (its forward times: only for that pass)
            result.reference_s = self.reference.before_training_s(
                c, self._times(c, cost, counts, [0] * len(counts)), placement)
        result.step_s = result.pipeline_s + result.tail_s \
            + result.reference_s / self.reference.epochs
        if result.peak_bytes > self.memory_bytes:
            rank = peaks.index(result.peak_bytes)
            result.error = (f"pipeline rank {rank} needs {result.peak_bytes / 2**30:.2f} GiB "
                            f"({states[rank] / 2**30:.2f} model states, "
                            f"{activations[rank] / 2**30:.2f} activations), over "
                            f"{self.memory_bytes / 2**30:.2f} GiB")
        return result

    def _simulate(self, c: Candidate, cost: BlockCosts, kept: list[KeptBytes],
                  counts: list[int], recomputed: list[int]) -> tuple[float, list[float]]:
        """(makespan, per-rank activation peak); the same for every ZeRO stage (cached)."""
        block = c.recompute == BLOCK
        key = (c.tp, c.sequence_parallel, c.pp, c.dp, c.cp, c.cp_mode, c.ep, c.chunks,
               c.micro_batch,
               c.microbatches, c.schedule, tuple(recomputed), block)
        if key in self._cache:
            return self._cache[key]
        costs = self._times(c, cost, counts, recomputed)
        full = [k.by_count[0] for k in kept]
        if block:  # the backward reruns one block at a time: its kept inputs and one block
            boundary = cost.boundary_bytes / c.tp if c.sequence_parallel else cost.boundary_bytes
            full = [k.by_count[n] + (k.by_count[0] - k.by_count[1]) + boundary
                    for k, n in zip(kept, recomputed)]
        memory = MemoryModel(full=full,
                             kept=[k.by_count[n] for k, n in zip(kept, recomputed)],
                             per_stage=True)

        def replay(m: int) -> tuple[float, list[float]]:
            flags = tuple(k > 0 for k in recomputed)
            shape = (c.schedule, c.pp, m, c.chunks, flags)
            if shape not in self._schedules:
                self._schedules[shape] = make_schedule(c.schedule, c.pp, m,
                                                       stages_per_rank=c.chunks,
                                                       recompute=list(flags),
                                                       reference=self.reference.per_step)
            simulated = simulate(self._schedules[shape], costs, memory)
            return simulated.makespan, list(simulated.peak_memory)

        # Past a few rounds of the pipeline, one more round of pp micro-batches adds the same
        # time and memory (steady 1F1B: none; GPipe: pp micro-batches' worth): replay two
        # short runs and extend the line, instead of replaying hundreds of micro-batches.
        short = EXACT_ROUNDS * c.pp * c.chunks
        if c.microbatches <= short + c.pp:
            self._cache[key] = replay(c.microbatches)
        else:
            (t1, m1), (t2, m2) = replay(short), replay(short + c.pp)
            rounds = (c.microbatches - short) / c.pp
            self._cache[key] = (t1 + rounds * (t2 - t1),
                                [a + rounds * (b - a) for a, b in zip(m1, m2)])
        return self._cache[key]

    def _recomputed(self, c: Candidate, cost: BlockCosts, kept: list[KeptBytes],
                    counts: list[int], states: list[float]) -> list[int]:
        """Blocks each stage recomputes. "budget": the fewest, the same number on every
        stage (a bisection over it), that keep every rank within the memory limit; at run
        time Merak's stage-aware choice (``activation_memory_budget``) lowers it further on
        the later stages."""
        if c.recompute == "off":
            return [0] * len(counts)
        if c.recompute in ("full", BLOCK):
            return list(counts)
        if c.recompute != "budget":
            raise ValueError(f"recompute must be one of {(*RECOMPUTE_CHOICES, BLOCK)}, got "
                             f"{c.recompute!r}")

        def fits(k: int) -> bool:
            recomputed = [min(k, n) for n in counts]
            _, activations = self._simulate(c, cost, kept, counts, recomputed)
            return all(s + a <= self.memory_bytes for s, a in zip(states, activations))

        low, high = 1, max(counts)  # the schedule may need some recomputation: k >= 1
        if not fits(high):
            raise ValueError("does not fit even recomputing every block")
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if fits(middle) else (middle + 1, high)
        return [min(low, n) for n in counts]

    def _tail(self, c: Candidate, params: list[float], cost: BlockCosts,
              counts: list[int]) -> float:
        """The slowest rank's exposed data-parallel traffic (and ZeRO-3's gathers) and its
        optimizer step (over its 1/dp share under ZeRO); dp x cp with context parallelism."""
        cl, worst = self.cluster, 0.0
        placement = placement_of(c.schedule, c.pp, c.chunks)
        dp = c.replicas  # (the replicas of a weight: tp-strided, dp x cp of them)
        for rank in range(c.pp):
            mine = sum(p for s, p in enumerate(params) if placement[s] == rank)
            # expert gradients are reduced (and ZeRO-1 sharded) over the ep rank's own
            # replicas: dp x cp / ep of them
            experts = self._block_experts(c) * sum(
                n for s, n in enumerate(counts) if placement[s] == rank)
            mine -= experts
            grads = 4 * mine
            edp = dp // c.ep
            step = cost.optimizer_s_per_param * (
                mine / dp + experts / edp if c.zero >= 1 else mine + experts)
            if c.zero >= 2:  # (the experts' units over their edp group)
                sync = cl.all_gather_s(grads, dp, c.tp) \
                    + cl.all_gather_s(4 * experts, edp, c.tp * c.ep)  # reduce-scatters
                gathers = cl.all_gather_s(4 * mine, dp, c.tp) \
                    + cl.all_gather_s(4 * experts, edp, c.tp * c.ep)
                if c.zero == 3:  # every micro-batch gathers each block for forward and backward
                    sync += 2 * c.microbatches * gathers
                else:  # the weights gathered once per step, after the optimizer
                    sync += gathers
            else:
                sync = cl.all_reduce_s(grads, dp, c.tp) \
                    + cl.all_reduce_s(4 * experts, edp, c.tp * c.ep)
                # buckets start during the rank's last backward: what outlasts it shows
                last_backward = sum(n for s, n in enumerate(counts) if placement[s] == rank) \
                    * cost.backward_s / c.tp / c.chunks
                sync = max(sync - last_backward, 0.1 * sync)
                if c.zero == 1:  # each rank steps its share, then broadcasts it
                    sync += cl.all_gather_s(4 * mine, dp, c.tp) \
                        + cl.all_gather_s(4 * experts, edp, c.tp * c.ep)
            worst = max(worst, sync + step)
        return worst
