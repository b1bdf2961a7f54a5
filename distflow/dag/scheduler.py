"""The per-worker scheduler: runs the graph once per step on this worker.

There is no global barrier between nodes. Workers meet only where a collective needs
them: in `collective` nodes (FSDP forwards and updates), in the reshards that move the
store to the next layout, and in a refilling filter's count. Those run on the main thread
in the graph's order, which is the same on every worker, so the collectives line up.
Every other node runs on a small thread pool as soon as its inputs exist
(`overlap=True`): a rule reward on the CPU while the reference scores, and chunk by chunk
behind a streaming rollout. With `overlap=False` the nodes run one after another in the
same order (the comparison point, and the simplest thing to debug).

`begin`, `run_node`, `run_stream` and `timed` are also what another execution strategy
drives: the centralized baseline (`runtime/centralized.py`) runs one node at a time on
the driver's command with them.

Each node run is recorded as a span; `chrome_trace` turns a step's spans into a trace
that chrome://tracing or Perfetto shows, one row per thread.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.distributed as dist

from distflow.collectives import all_gather_objects, all_reduce_int
from distflow.coordinator.layout import LAYOUT_ORDER
from distflow.coordinator.placement import Placement
from distflow.coordinator.store import LocalStore
from distflow.dag.graph import Graph, Node
from distflow.data.batch import FILTERED_OUT, Batch


class NodeFailed(RuntimeError):
    """A node raised: names the node, the worker and the step; chained to the original."""


class NodeContext:
    """What a node's callable sees: the worker's context (engines, config, step, metrics)
    plus this node's `params` and `node`, and `counts_rows`: whether this worker's rows
    count in a sum over workers. In the `groups` layout every member of a rollout
    replica holds all of the replica's rows, so only its first member counts them; a
    node that sums numbers about its rows over workers (a count, a mean's parts) adds
    zeros where this is False."""

    def __init__(self, base: Any, node: Node, counts_rows: bool):
        self._base, self.node, self.params, self.counts_rows = base, node, node.params, counts_rows

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


class RefillSource(Protocol):
    """Where a refilling filter gets more prompts (DAPO's dynamic sampling)."""

    target_groups: int  # groups wanted over all workers
    max_rounds: int

    def prompts(self, round_: int) -> Batch: ...  # this worker's extra prompts (the step's source fields)

    def group_keys(self, batch: Batch) -> list[int]: ...  # a global key per row; rows of one group share it

    def renumber(self, batch: Batch, kept_keys: list[int]) -> Batch: ...  # after trimming to target_groups


@dataclass
class Span:
    node: str
    thread: str
    start: float
    end: float
    chunk: int | None = None


class Scheduler:
    def __init__(self, graph: Graph, *, placement: Placement, overlap: bool = True, threads: int = 2,
                 refill: RefillSource | None = None, on_node: Callable[[str], None] | None = None,
                 train_ranks: int | None = None):
        """`train_ranks`: the data-parallel ranks that train the rows, each needing one
        (default: the placement's training layout's; the rollout workers of a disaggregated
        run pass the train side's)."""
        self.graph, self.placement = graph, placement
        self.train_ranks = placement.train.dp_size if train_ranks is None else train_ranks
        self.fns = graph.resolve()
        self.refill, self.on_node = refill, on_node
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        # pool threads use the worker's intra-op thread count (OpenMP's is per thread)
        self.pool = (ThreadPoolExecutor(threads, thread_name_prefix="dag", initializer=torch.set_num_threads,
                                        initargs=(torch.get_num_threads(),)) if overlap else None)
        self._lock = threading.Lock()
        self.spans: list[Span] = []
        self.counters: dict[str, float] = {}  # per step, the same on every worker (e.g. refill rounds)
        self.step = 0
        self._placed: LocalStore | None = None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    # ------------------------------------------------------------------ a step

    def run(self, ctx: Any, store: LocalStore, step: int) -> list[Span]:
        """Run every node on this worker's store; returns the step's spans."""
        self.begin(step)
        self._run_nodes(ctx, store, self.graph.order, top_level=True)
        return self.spans

    def begin(self, step: int) -> None:
        """A new step: spans, counters and the store's layout start afresh."""
        self.step, self.spans, self.state, self.counters = step, [], "local", {}
        self._placed = None  # the store whose rows the last move placed, while no filter has changed them

    def _run_nodes(self, ctx: Any, store: LocalStore, order: list[str], top_level: bool) -> None:
        futures: dict[str, Future] = {}
        handled: set[str] = set()  # consumers already run chunk by chunk behind a stream
        try:
            for name in order:
                if name in handled:
                    continue
                node = self.graph.by_name[name]
                for parent in self.graph.parents[name]:
                    if parent in futures:
                        futures[parent].result()
                if LAYOUT_ORDER[node.layout] > LAYOUT_ORDER[self.state]:
                    if self.placement.moves(self.state, node.layout):
                        self._wait(futures)  # rows are about to change under them
                        same_rows = self._placed is store
                        self.timed(f"reshard_{node.layout}",
                                    lambda: self.placement.move(store, self.state, node.layout, same_rows))
                        self._placed = store
                    self.state = node.layout
                if node.stream:
                    handled |= self.run_stream(ctx, store, node, order, futures)
                elif node.role == "filter":
                    self._wait(futures)
                    self._run_filter(ctx, store, node, top_level)
                elif node.collective or self.pool is None:
                    self.run_node(ctx, store, node)
                else:
                    futures[name] = self.pool.submit(self.run_node, ctx, store, node)
            self._wait(futures)
        except NodeFailed:
            self._wait(futures, quiet=True)
            raise

    @staticmethod
    def _wait(futures: dict[str, Future], quiet: bool = False) -> None:
        for future in futures.values():
            if quiet:
                future.exception()
            else:
                future.result()

    # ------------------------------------------------------------------ one node

    def _call(self, ctx: Any, node: Node, batch: Batch, chunk: int | None = None) -> Any:
        if self.on_node is not None:
            self.on_node(node.name)
        start = time.perf_counter()
        try:
            return self.fns[node.name](self._context(ctx, node), batch)
        except NodeFailed:
            raise
        except Exception as e:
            raise self._failed(node, e) from e
        finally:
            self._span(node.name, start, chunk)

    def _context(self, ctx: Any, node: Node) -> NodeContext:
        return NodeContext(ctx, node, self._counts_rows(node))

    def _counts_rows(self, node: Node) -> bool:
        """See `NodeContext.counts_rows`."""
        return node.layout != "groups" or self.placement.rollout.tp_rank(self.rank) == 0

    def _failed(self, node: Node, error: Exception) -> NodeFailed:
        """One line; the original exception (and its traceback) is chained as the cause."""
        return NodeFailed(f"node '{node.name}' failed on worker {self.rank} in step {self.step}: "
                          f"{type(error).__name__}: {error}")

    def _span(self, name: str, start: float, chunk: int | None = None) -> None:
        with self._lock:
            self.spans.append(Span(name, threading.current_thread().name, start, time.perf_counter(), chunk))

    def timed(self, name: str, fn: Callable[[], None]) -> None:
        if self.on_node is not None:
            self.on_node(name)
        start = time.perf_counter()
        try:
            fn()
        except Exception as e:
            raise NodeFailed(f"'{name}' failed on worker {self.rank} in step {self.step}: "
                             f"{type(e).__name__}: {e}") from e
        finally:
            self._span(name, start)

    def _inputs(self, store: LocalStore, node: Node) -> Batch:
        with self._lock:
            return store.get(*node.inputs)

    def _check(self, node: Node, out: Any, rows: int) -> Batch:
        if out is None and not node.outputs:
            return Batch()
        if not isinstance(out, Batch):
            raise NodeFailed(f"node '{node.name}' returned {type(out).__name__}, not a Batch")
        if sorted(out.keys()) != sorted(node.outputs):
            raise NodeFailed(f"node '{node.name}' returned fields {sorted(out.keys())}, "
                             f"declared outputs {sorted(node.outputs)}")
        if node.outputs and len(out) != rows:
            raise NodeFailed(f"node '{node.name}' returned {len(out)} rows for {rows} input rows")
        return out

    def run_node(self, ctx: Any, store: LocalStore, node: Node) -> None:
        batch = self._inputs(store, node)
        out = self._check(node, self._call(ctx, node, batch), len(store))
        if node.outputs:
            with self._lock:
                store.put(out)

    # ------------------------------------------------------------------ streaming

    def _stream_consumers(self, node: Node, order: list[str]) -> list[Node]:
        """Nodes that can run on each chunk: chunk-capable, local, no collectives, and
        needing nothing but the stream's outputs and fields that exist before it."""
        before = set(self.graph.sources) | {f for n in order[:order.index(node.name)]
                                            for f in self.graph.by_name[n].outputs}
        out = []
        for name in order[order.index(node.name) + 1:]:
            c = self.graph.by_name[name]
            if (c.chunked and not c.collective and c.layout == "local"
                    and set(self.graph.parents[name]) <= {node.name} | {self.graph.producer.get(f) for f in before}
                    and set(c.inputs) <= before | set(node.outputs)):
                out.append(c)
        return out

    def run_stream(self, ctx: Any, store: LocalStore, node: Node, order: list[str],
                    futures: dict[str, Future]) -> set[str]:
        consumers = self._stream_consumers(node, order) if self.pool is not None else []
        for c in consumers:  # their other inputs are there before their first chunk runs
            for parent in self.graph.parents[c.name]:
                if parent in futures:
                    futures[parent].result()
        pieces: list[Batch] = []
        per_consumer: dict[str, list[Future]] = {c.name: [] for c in consumers}
        rows_done = 0
        chunks: Iterator | None = None
        while True:
            start = time.perf_counter()
            try:
                if chunks is None:
                    if self.on_node is not None:
                        self.on_node(node.name)
                    chunks = iter(self.fns[node.name](self._context(ctx, node), self._inputs(store, node)))
                rows, chunk = next(chunks)
            except StopIteration:
                break
            except Exception as e:
                raise self._failed(node, e) from e
            self._span(node.name, start, len(pieces))
            rows = list(rows)
            if rows != list(range(rows_done, rows_done + len(rows))):
                raise NodeFailed(f"node '{node.name}' streamed rows {rows[:3]}... out of order")
            rows_done += len(rows)
            chunk = self._check(node, chunk, len(rows))
            pieces.append(chunk)
            for c in consumers:  # start the consumers on this chunk while the next one generates
                per_consumer[c.name].append(self.pool.submit(self._run_chunk, ctx, store, c, rows, chunk,
                                                             len(pieces) - 1))
        if rows_done != len(store):
            raise NodeFailed(f"node '{node.name}' streamed {rows_done} rows for {len(store)} input rows")
        with self._lock:
            store.put(Batch.concat(pieces) if pieces else Batch())
        for c in consumers:
            futures[c.name] = self._joined(store, c, per_consumer[c.name])
        return {c.name for c in consumers}

    def _run_chunk(self, ctx: Any, store: LocalStore, node: Node, rows: list[int], chunk: Batch, index: int) -> Batch:
        own = [f for f in node.inputs if f not in chunk]
        with self._lock:
            batch = store.get(*own).select(rows) if own else Batch()
        batch.update(Batch({f: chunk.tensors[f] for f in node.inputs if f in chunk.tensors},
                           {f: chunk.meta[f] for f in node.inputs if f in chunk.meta}))
        return self._check(node, self._call(ctx, node, batch, index), len(rows))

    def _joined(self, store: LocalStore, node: Node, parts: list[Future]) -> Future:
        """A future for the consumer's whole output: when its last chunk is done, the
        chunks are put in the store in order (a callback, so no pool thread waits)."""
        joined: Future = Future()
        left = [len(parts)]

        def one_done(_: Future) -> None:
            with self._lock:
                left[0] -= 1
                if left[0]:
                    return
            failed = next((p.exception() for p in parts if p.exception() is not None), None)
            if failed is not None:
                joined.set_exception(failed)
                return
            try:  # what a callback raises is only logged: the step would wait for `joined` for ever
                out = Batch.concat([p.result() for p in parts]) if parts else Batch()
                with self._lock:
                    store.put(out)
            except Exception as e:
                joined.set_exception(NodeFailed(f"node '{node.name}' failed on worker {self.rank} in step "
                                                f"{self.step}: its chunks' outputs do not join: "
                                                f"{type(e).__name__}: {e}"))
                return
            joined.set_result(None)

        if not parts:
            left[0] = 1
            one_done(joined)
        for part in parts:
            part.add_done_callback(one_done)
        return joined

    # ------------------------------------------------------------------ filters

    def _run_filter(self, ctx: Any, store: LocalStore, node: Node, top_level: bool) -> None:
        self._placed = None  # the rows change (and a refill moves other rows meanwhile)
        keep = self._check(node, self._call(ctx, node, self._inputs(store, node)), len(store))
        store.put(keep)
        if node.refill and self.refill is not None:
            if top_level:  # inside a refill round the rows stay, flagged, for the final choice
                self.timed(f"{node.name}_refill", lambda: self._refill(ctx, store, node))
                self._placed = None
            return
        kept = keep[node.outputs[0]].bool()
        if top_level and self._after_responses(node) and self._too_few_to_train(node, kept):
            # Fewer rows kept over all workers than training ranks, each of which needs one: the rows
            # stay, the dropped ones with no response tokens (and flagged, for the metrics), so the
            # update trains on the kept ones alone (none: no update), as one worker does with the kept rows.
            batch = store.all()  # a worker without rows too: every worker's rows have the flag, or none's
            if "response_mask" in batch.tensors:
                mask = batch.tensors["response_mask"]
                batch.tensors["response_mask"] = mask * kept.unsqueeze(-1).to(mask.dtype)
            dropped = batch.tensors.get(FILTERED_OUT, torch.zeros_like(kept))
            batch.tensors[FILTERED_OUT] = dropped | ~kept
            self.counters[f"{node.name}/masked_instead_of_dropped"] = 1.0
            return
        store.replace(store.all().select(kept.nonzero().flatten()))

    def _after_responses(self, node: Node) -> bool:
        """Whether the graph has responses before `node` (decided from the graph, the same on
        every worker, whatever rows each holds)."""
        return "response_mask" in self.graph.sources or any(
            "response_mask" in self.graph.by_name[a].outputs for a in self.graph.ancestors(node.name))

    def _too_few_to_train(self, node: Node, kept: torch.Tensor) -> bool:
        """Whether the rows kept over all workers (a replica's counted once) are fewer than
        the training ranks (`train_ranks`): a collective, on every worker alike."""
        if self.placement.train.world_size == 1:  # its rows are all the rows
            return int(kept.sum()) < self.train_ranks
        return all_reduce_int(int(kept.sum()) if self._counts_rows(node) else 0) < self.train_ranks

    def _refill(self, ctx: Any, store: LocalStore, node: Node) -> None:
        """Re-run the filter's ancestors on new prompts until enough groups pass over all
        workers (or `max_rounds`), then keep exactly `target_groups`: passing groups
        first, then (only if too few passed) rejected ones, each by lowest global key,
        so the choice is the same for any number of workers. Rejected groups keep the
        batch's shape but are masked (no response tokens, `FILTERED_OUT`): nothing of
        them is trained on or counted in the step's metrics."""
        src, flag, rounds = self.refill, node.outputs[0], 0
        batches = [store.all()]
        counted = self._counts_rows(node)  # a replica's groups are counted and offered once, by its first member

        def passed(batch: Batch) -> set[int]:  # a group with a row an earlier filter masked out does not pass
            keys = src.group_keys(batch)
            masked = {k for k, out in zip(keys, batch[FILTERED_OUT].tolist()) if out} if FILTERED_OUT in batch else ()
            return {k for k, ok in zip(keys, batch[flag].tolist()) if ok and k not in masked}

        while (all_reduce_int(sum(len(passed(b)) for b in batches) if counted else 0) < src.target_groups
               and rounds < src.max_rounds):
            rounds += 1
            more, state = LocalStore(), self.state
            more.put(src.prompts(rounds))
            self.state = "local"
            self._run_nodes(ctx, more, self.graph.ancestors(node.name) + [node.name], top_level=False)
            self.state = state
            more_rows = more.all()
            if FILTERED_OUT in batches[0]:  # inside a round an earlier filter drops its rows: none are masked
                more_rows.tensors[FILTERED_OUT] = torch.zeros(len(more_rows), dtype=torch.bool)
            batches.append(more_rows)
        batch = Batch.concat(batches) if len(batches) > 1 else batches[0]
        keys, good = src.group_keys(batch), passed(batch)
        mine = sorted({(k not in good, k) for k in keys}) if counted else []
        chosen = sorted(k for _, k in sorted(x for part in all_gather_objects(mine) for x in part)[:src.target_groups])
        chosen_set = set(chosen)
        rows = src.renumber(batch.select([i for i, k in enumerate(keys) if k in chosen_set]), chosen)
        passed_groups = all_reduce_int(len(good) if counted else 0)
        if passed_groups < src.target_groups:  # rejected groups fill the batch (on every worker alike)
            # ... to keep its shape, training on none of their tokens: their signal is none (all rewards
            # equal), and a shaped reward (DAPO's overlong penalty) would otherwise give them advantages
            rejected = torch.tensor([k not in good for k in src.group_keys(rows)], dtype=torch.bool)
            if "response_mask" in rows.tensors:
                mask = rows.tensors["response_mask"]
                rows.tensors["response_mask"] = mask * (~rejected).unsqueeze(-1).to(mask.dtype)
            rows.tensors[FILTERED_OUT] = rows.tensors.get(FILTERED_OUT, torch.zeros_like(rejected)) | rejected
        store.replace(rows)
        self.counters[f"{node.name}/refill_rounds"] = float(rounds)
        self.counters[f"{node.name}/passed_groups"] = float(passed_groups)


def chrome_trace(spans: list[Span], rank: int, t0: float | None = None) -> dict:
    """Spans as Chrome trace events (open in chrome://tracing or ui.perfetto.dev)."""
    t0 = min((s.start for s in spans), default=0.0) if t0 is None else t0
    threads = {name: i for i, name in enumerate(dict.fromkeys(s.thread for s in spans))}
    events = [{"name": s.node + ("" if s.chunk is None else f"[{s.chunk}]"), "cat": s.node, "ph": "X",
               "ts": (s.start - t0) * 1e6, "dur": (s.end - s.start) * 1e6, "pid": rank, "tid": threads[s.thread]}
              for s in spans]
    events += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}}
               for name, tid in threads.items()]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def node_seconds(spans: list[Span]) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in spans:
        out[s.node] = out.get(s.node, 0.0) + s.end - s.start
    return out
