"""The per-worker scheduler on one process: ordering, overlap and streaming shown by
recorded events (not timings), failures, filters, refill, traces."""

from __future__ import annotations

import threading

import pytest
import torch

from distflow.coordinator.layout import Layout
from distflow.coordinator.store import LocalStore
from distflow.dag.graph import Graph, Node
from distflow.dag.scheduler import NodeFailed, Placement, Scheduler, chrome_trace, node_seconds
from distflow.data.batch import FILTERED_OUT, Batch
from helpers import run_gloo

WAIT = 10.0  # seconds a node waits for an event that overlap should produce


class Ctx:
    def __init__(self):
        self.events = {name: threading.Event() for name in ("chunk0_scored", "b_started")}
        self.seen: dict[str, bool] = {}
        self.threads: dict[str, str] = {}


def source(n=6) -> LocalStore:
    store = LocalStore()
    store.put(Batch({"x": torch.arange(n, dtype=torch.float32), "group": torch.arange(n) // 2,
                     "prompt_mask": torch.ones(n, 2, dtype=torch.long)}))
    return store


def generate(ctx, batch):
    for start in range(0, len(batch), 2):
        rows = range(start, start + 2)
        yield rows, Batch({"y": batch["x"][start:start + 2] * 10})
        if start == 0:  # does a consumer score chunk 0 while this stream is still open?
            ctx.seen["chunk0_scored_before_stream_end"] = ctx.events["chunk0_scored"].wait(
                WAIT if ctx.overlap else 0.2)


def score(ctx, batch):
    if float(batch["y"][0]) == 0.0:
        ctx.events["chunk0_scored"].set()
    return Batch({"s": batch["y"] + 1})


def node_a(ctx, batch):
    ctx.seen["a_saw_b_running"] = ctx.events["b_started"].wait(WAIT if ctx.overlap else 0.2)
    return Batch({"a": batch["x"] * 0})


def node_b(ctx, batch):
    ctx.events["b_started"].set()
    return Batch({"b": batch["x"] * 0})


def total(ctx, batch):
    ctx.threads["total"] = threading.current_thread().name
    return Batch({"t": batch["s"] + batch["a"] + batch["b"]})


def graph() -> Graph:
    return Graph([
        Node(name="gen", role="rollout", fn=generate, inputs=("x",), outputs=("y",), stream=True),
        Node(name="score", role="reward", fn=score, inputs=("y",), outputs=("s",)),
        Node(name="a", role="custom", fn=node_a, inputs=("x",), outputs=("a",)),
        Node(name="b", role="custom", fn=node_b, inputs=("x",), outputs=("b",)),
        Node(name="total", role="actor_forward", fn=total, inputs=("s", "a", "b"), outputs=("t",)),
    ], ["x", "group", "prompt_mask"])


def run(g: Graph, overlap: bool, store=None, **kw):
    ctx = Ctx()
    ctx.overlap = overlap
    store = store or source()
    sched = Scheduler(g, placement=Placement(Layout(1), Layout(1)), overlap=overlap, **kw)
    try:
        spans = sched.run(ctx, store, step=3)
    finally:
        sched.close()
    return ctx, store, spans, sched


@pytest.mark.parametrize("overlap", [True, False])
def test_results_are_the_same_with_and_without_overlap(overlap):
    ctx, store, spans, _ = run(graph(), overlap)
    assert store.get("t")["t"].tolist() == [10 * i + 1 for i in range(6)]
    assert ctx.threads["total"] == "MainThread"  # a collective node runs on the main thread
    assert ctx.seen["chunk0_scored_before_stream_end"] is overlap
    assert ctx.seen["a_saw_b_running"] is overlap
    # spans are recorded as calls finish; two pool threads may finish chunks out of order
    chunks = sorted((s.chunk for s in spans if s.node == "score"), key=lambda c: -1 if c is None else c)
    assert chunks == ([0, 1, 2] if overlap else [None])


def test_trace_and_node_seconds():
    _, _, spans, _ = run(graph(), True)
    trace = chrome_trace(spans, rank=1)
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"gen[0]", "gen[2]", "score[0]", "a", "b", "total"} <= names
    assert all(e["pid"] == 1 and e["dur"] >= 0 for e in trace["traceEvents"] if e["ph"] == "X")
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"} >= {"MainThread"}
    assert set(node_seconds(spans)) == {"gen", "score", "a", "b", "total"}


def boom(ctx, batch):
    raise KeyError("bad sample")


@pytest.mark.parametrize("overlap", [True, False])
def test_a_failing_node_is_named_with_worker_step_and_traceback(overlap):
    g = graph().edited(add=[Node(name="a", role="custom", fn=boom, inputs=("x",), outputs=("a",))])
    with pytest.raises(NodeFailed, match=r"node 'a' failed on worker 0 in step 3: KeyError: 'bad sample'") as info:
        run(g, overlap)
    assert "\n" not in str(info.value)  # one line; the original error and its traceback are the cause
    assert isinstance(info.value.__cause__, KeyError) and info.value.__cause__.__traceback__ is not None


def wrong_fields(ctx, batch):
    return Batch({"oops": batch["x"]})


def wrong_rows(ctx, batch):
    return Batch({"b": batch["x"][:1]})


@pytest.mark.parametrize("fn, message", [
    (wrong_fields, r"node 'b' returned fields \['oops'\], declared outputs \['b'\]"),
    (wrong_rows, "node 'b' returned 1 rows for 6 input rows"),
])
def test_a_node_must_return_what_it_declares(fn, message):
    g = graph().edited(add=[Node(name="b", role="custom", fn=fn, inputs=("x",), outputs=("b",))])
    with pytest.raises(NodeFailed, match=message):
        run(g, False)


def slow_lookup(ctx, batch):
    threading.Event().wait(0.3)
    return Batch({"hint": batch["x"] + 100})


def score_with_hint(ctx, batch):
    ctx.events["chunk0_scored"].set()
    return Batch({"s": batch["y"] + batch["hint"]})


def test_a_chunked_consumer_waits_for_its_other_parents():
    """A chunked reward that also reads a slow node's field placed before the stream: its
    first chunk read the field before the node (on the pool) had written it."""
    g = Graph([
        Node(name="lookup", role="custom", fn=slow_lookup, inputs=("x",), outputs=("hint",)),
        Node(name="gen", role="rollout", fn=generate, inputs=("x",), outputs=("y",), stream=True),
        Node(name="score", role="reward", fn=score_with_hint, inputs=("y", "hint"), outputs=("s",)),
    ], ["x", "group", "prompt_mask"])
    assert g.order == ["lookup", "gen", "score"]
    _, store, _, _ = run(g, True)
    assert store.get("s")["s"].tolist() == [11 * i + 100 for i in range(6)]


def score_in_two_forms(ctx, batch):
    s = batch["y"] + 1
    if float(batch["y"][0]) == 0.0:
        ctx.events["chunk0_scored"].set()
        return Batch({"s": s})
    return Batch(meta={"s": s.tolist()})


def test_chunks_that_do_not_join_fail_the_step_not_hang_it():
    """A chunked consumer whose chunks cannot be joined (a tensor field in one, a list in
    another): the join raised in a future's callback, which only logs, and the step waited
    for ever."""
    g = graph().edited(add=[Node(name="score", role="reward", fn=score_in_two_forms, inputs=("y",), outputs=("s",))])
    result: list = []
    runner = threading.Thread(target=lambda: result.append(_raised(lambda: run(g, True))), daemon=True)
    runner.start()
    runner.join(WAIT)
    assert result, "the step hung"
    assert isinstance(result[0], NodeFailed) and "node 'score' failed on worker 0 in step 3: its chunks' outputs " \
        "do not join" in str(result[0])


def _raised(fn):
    try:
        fn()
    except Exception as e:
        return e
    return None


def keep_even_groups(ctx, batch):
    return Batch({"keep": batch["group"] % 2 == 0})


def double(ctx, batch):
    return Batch({"d": batch["x"] * 2})


def test_filter_keeps_rows_and_later_nodes_see_only_them():
    g = Graph([Node(name="f", role="filter", fn=keep_even_groups, inputs=("group",), outputs=("keep",)),
               Node(name="d", role="advantage", fn=double, inputs=("x",), outputs=("d",))],
              ["x", "group", "prompt_mask"])
    _, store, _, _ = run(g, True)
    assert store.get("x")["x"].tolist() == [0, 1, 4, 5]
    assert store.get("d")["d"].tolist() == [0, 2, 8, 10]


class Refill:
    """Round r brings 3 new groups (keys 10r..10r+2) of 2 rows; odd groups pass."""

    target_groups, max_rounds = 4, 5

    def __init__(self):
        self.rounds = 0

    def prompts(self, round_):
        self.rounds = round_
        groups = torch.tensor([10 * round_ + g for g in range(3) for _ in range(2)])
        return Batch({"x": groups.float(), "group": groups, "prompt_mask": torch.ones(6, 2, dtype=torch.long)})

    def group_keys(self, batch):
        return batch["group"].tolist()

    def renumber(self, batch, kept):
        index = {k: i for i, k in enumerate(kept)}
        batch.tensors["mini"] = torch.tensor([index[k] // 2 for k in batch["group"].tolist()])
        return batch


def keep_odd_groups(ctx, batch):
    ctx.seen["calls"] = ctx.seen.get("calls", 0) + 1
    return Batch({"keep": batch["group"] % 2 == 1})


def test_refilling_filter_reruns_its_ancestors_until_the_batch_is_full():
    g = Graph([Node(name="d", role="custom", fn=double, inputs=("x",), outputs=("d",)),
               Node(name="f", role="filter", fn=keep_odd_groups, inputs=("group", "d"), outputs=("keep",),
                    refill=True),
               Node(name="after", role="advantage", fn=lambda ctx, b: Batch({"z": b["d"] + 1}), inputs=("d",),
                    outputs=("z",))], ["x", "group", "prompt_mask"])
    refill = Refill()
    ctx, store, spans, sched = run(g, True, refill=refill)
    # step batch: groups 0,1,2 -> 1 passes; round 1: 10,11,12 -> 11; round 2: 21; round 3: 31 -> 4 groups
    assert refill.rounds == 3 and ctx.seen["calls"] == 4
    assert sorted(set(store.get("group")["group"].tolist())) == [1, 11, 21, 31]
    assert store.get("z")["z"].tolist() == [2 * x + 1 for x in store.get("x")["x"].tolist()]
    assert store.get("mini")["mini"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert sched.counters == {"f/refill_rounds": 3.0, "f/passed_groups": 4.0}


def test_refill_tops_up_with_rejected_groups_when_rounds_run_out_and_trains_on_none_of_them():
    """They keep the batch's shape. DAPO's overlong penalty, after the filter, gave a
    rejected group (all rewards equal: no signal) full-size advantages from length alone,
    and its tokens counted in the loss's normaliser: they are masked."""
    g = Graph([Node(name="f", role="filter", fn=keep_odd_groups, inputs=("group",), outputs=("keep",),
                    refill=True)], ["x", "group", "prompt_mask", "response_mask"])
    refill = Refill()
    refill.max_rounds = 1
    refill.prompts = lambda round_: _with_responses(Refill.prompts(refill, round_))
    store = source()
    store.put(Batch({"response_mask": torch.ones(6, 3, dtype=torch.long)}))
    _, store, _, _ = run(g, False, store=store, refill=refill)
    # passed: 1, 11; then the lowest rejected keys: 0, 2
    rows = store.all()
    assert sorted(set(rows["group"].tolist())) == [0, 1, 2, 11]
    rejected = torch.tensor([g in (0, 2) for g in rows["group"].tolist()])
    assert torch.equal(rows[FILTERED_OUT], rejected)
    assert torch.equal(rows["response_mask"].sum(-1) > 0, ~rejected)


class RankRefill(Refill):
    """Rank r's rows: groups 2r and 2r+1 of the step, 10r+10+2r and +1 in round r: each
    group's two rows on one rank (distinct sample ids), odd groups pass."""

    target_groups, max_rounds = 4, 3

    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def prompts(self, round_):
        self.rounds = round_
        return _rank_rows([10 * round_ + 2 * self.rank + g for g in range(2)])


def _rank_rows(groups):
    keys = torch.tensor([g for g in groups for _ in range(2)])
    return Batch({"x": keys.float(), "group": keys, "prompt_mask": torch.ones(len(keys), 2, dtype=torch.long),
                  "sample_id": keys * 2 + torch.arange(len(keys)) % 2})


def _refill_on_replicas(rank, world, replica_size):
    g = Graph([Node(name="f", role="filter", fn=keep_odd_groups, inputs=("group",), outputs=("keep",),
                    refill=True)], ["x", "group", "prompt_mask", "sample_id"])
    store, ctx = LocalStore(), Ctx()
    store.put(_rank_rows([2 * rank, 2 * rank + 1]))
    sched = Scheduler(g, placement=Placement(Layout(world, tp_size=replica_size), Layout.data_parallel(world)),
                      overlap=False, refill=RankRefill(rank))
    try:
        sched.run(ctx, store, step=1)
    finally:
        sched.close()
    return sorted(set(store.get("group")["group"].tolist())), sched.counters


def _drop_the_step_s_own_rows(ctx, batch):
    return Batch({"fresh": batch["group"] >= 10})  # a refill round's rows pass


def _masked_then_refilled(rank, world):
    g = Graph([Node(name="drop", role="filter", fn=_drop_the_step_s_own_rows, inputs=("group",), outputs=("fresh",)),
               Node(name="f", role="filter", fn=keep_odd_groups, inputs=("group",), outputs=("keep",),
                    refill=True, deps=("drop",))], ["x", "group", "prompt_mask", "sample_id", "response_mask"])
    store, ctx = LocalStore(), Ctx()
    rows = _rank_rows([2 * rank, 2 * rank + 1])
    rows.tensors["response_mask"] = torch.ones(len(rows), 3, dtype=torch.long)
    store.put(rows)
    refill = RankRefill(rank)
    refill.prompts = lambda round_: _with_responses(RankRefill.prompts(refill, round_))
    sched = Scheduler(g, placement=Placement(Layout(world), Layout.data_parallel(world)), overlap=False, refill=refill)
    try:
        sched.run(ctx, store, step=1)
    finally:
        sched.close()
    return sorted(set(store.get("group")["group"].tolist())), sched.counters


def _with_responses(batch):
    batch.tensors["response_mask"] = torch.ones(len(batch), 3, dtype=torch.long)
    return batch


def test_groups_an_earlier_filter_masked_do_not_pass_a_refilling_filter():
    """The first filter keeps none of the step's rows, so it masks them (each training rank
    needs a row). Odd groups 1 and 3 among them passed DAPO's filter all the same, and the
    step trained on 2 masked groups; they pass no more, and the refill brings 4 that train."""
    ranks = run_gloo(_masked_then_refilled, 2)
    assert [groups for groups, _ in ranks] == [[11, 21], [13, 23]]
    assert all(c == {"drop/masked_instead_of_dropped": 1.0, "f/refill_rounds": 2.0, "f/passed_groups": 4.0}
               for _, c in ranks)


def test_a_refill_counts_and_chooses_each_group_once_where_a_replica_s_members_all_hold_it():
    """With rollout.replica_size=2 both members of the replica hold every group in the
    filter's layout: the groups passed so far and the ones offered for the choice are
    each counted once, so the step gets the same groups as with one rank per replica."""
    alone = run_gloo(_refill_on_replicas, 2, 1)
    shared = run_gloo(_refill_on_replicas, 2, 2)
    # passed in the step: 1 and 3 of 4 wanted; round 1 brings 11 and 13
    assert [groups for groups, _ in alone] == [[1, 11], [3, 13]]
    assert [groups for groups, _ in shared] == [[1, 3, 11, 13]] * 2
    assert all(counters == {"f/refill_rounds": 1.0, "f/passed_groups": 4.0} for _, counters in alone + shared)


def _keep_the_first_row_of_rank_0(ctx, batch):
    return Batch({"keep": batch["sample_id"] == 0})


def _keep_none(ctx, batch):
    return Batch({"keep": batch["sample_id"] < 0})


def _response_tokens(ctx, batch):
    return Batch({"n": batch["response_mask"].sum(-1)})


def _keep_rank_0_s_rows(ctx, batch):
    return Batch({"first": batch["sample_id"] < 4})


def _filter_leaving_fewer_rows_than_ranks(rank, world, keep, train_ranks=None):
    """Each rank holds 4 rows; the filter keeps `keep` rows over both ranks, then a node
    runs in the training layout."""
    g = Graph([Node(name="f", role="filter", fn=keep, inputs=("sample_id",), outputs=("keep",)),
               Node(name="t", role="custom", fn=_response_tokens, inputs=("response_mask",), outputs=("n",),
                    layout="train")],
              ["x", "group", "prompt_mask", "sample_id", "response_mask"])
    store = LocalStore()
    ids = torch.arange(4) + 4 * rank
    store.put(Batch({"x": ids.float(), "group": ids // 2, "prompt_mask": torch.ones(4, 2, dtype=torch.long),
                     "sample_id": ids, "response_mask": torch.ones(4, 3, dtype=torch.long)}))
    sched = Scheduler(g, placement=Placement(Layout(world), Layout.data_parallel(world)), overlap=False,
                      train_ranks=train_ranks)
    try:
        sched.run(Ctx(), store, step=1)
    finally:
        sched.close()
    return len(store), int(store.get("n")["n"].sum()), sched.counters, int(store.get("filtered_out")["filtered_out"].sum())


@pytest.mark.parametrize("keep, tokens", [(_keep_the_first_row_of_rank_0, 3), (_keep_none, 0)])
def test_a_filter_that_keeps_fewer_rows_than_training_ranks_masks_the_others(keep, tokens):
    """One row (or none) kept over 2 ranks: the move to the training layout could not give
    each rank a row and the run stopped. The rows stay, the dropped ones without response
    tokens, so the update trains on the kept row alone (none: no update), as one worker does."""
    ranks = run_gloo(_filter_leaving_fewer_rows_than_ranks, 2, keep)
    assert sum(rows for rows, _, _, _ in ranks) == 8 and sum(n for _, n, _, _ in ranks) == tokens
    assert all(counters == {"f/masked_instead_of_dropped": 1.0} for _, _, counters, _ in ranks)
    assert sum(out for _, _, _, out in ranks) == 8 - tokens // 3  # flagged for the metrics, which leave them out


def test_a_one_worker_run_whose_filter_keeps_no_row_masks_them():
    """One worker whose filter keeps none of its rows (every group of the step had a failed
    episode): the update's forwards got an empty batch and the run stopped. The rows stay
    without response tokens (and flagged), so nothing trains."""
    assert _filter_leaving_fewer_rows_than_ranks(0, 1, _keep_none) == (4, 0, {"f/masked_instead_of_dropped": 1.0}, 4)


def test_rows_kept_for_fewer_training_ranks_than_train_elsewhere_are_masked():
    """A disaggregated run's rollout worker: one row kept for the 2 train workers' 2 ranks
    is masked (the train side could not give each a row), though its own layout has one."""
    assert _filter_leaving_fewer_rows_than_ranks(0, 1, _keep_the_first_row_of_rank_0, train_ranks=2) == \
        (4, 3, {"f/masked_instead_of_dropped": 1.0}, 3)


def _flag_columns_after_two_filters(rank, world):
    g = Graph([Node(name="f0", role="filter", fn=_keep_rank_0_s_rows, inputs=("sample_id",), outputs=("first",)),
               Node(name="f", role="filter", fn=_keep_the_first_row_of_rank_0, inputs=("sample_id",),
                    outputs=("keep",), deps=("f0",))],
              ["x", "group", "prompt_mask", "sample_id", "response_mask"])
    store = LocalStore()
    ids = torch.arange(4) + 4 * rank
    store.put(Batch({"x": ids.float(), "group": ids // 2, "prompt_mask": torch.ones(4, 2, dtype=torch.long),
                     "sample_id": ids, "response_mask": torch.ones(4, 3, dtype=torch.long)}))
    sched = Scheduler(g, placement=Placement(Layout(world), Layout.data_parallel(world)), overlap=False)
    try:
        sched.run(Ctx(), store, step=1)
    finally:
        sched.close()
    return len(store), store.all()[FILTERED_OUT].tolist() if FILTERED_OUT in store else None


def test_a_worker_an_earlier_filter_emptied_flags_its_rows_as_masked_too():
    """The first filter drops all of rank 1's rows; the second keeps one row over both
    ranks, so it masks. Rank 1, with no rows, had no flag column: rows a refill then made
    there lacked it beside rank 0's, and pieces with different fields cannot be moved or
    joined. Every worker's rows have the column (rank 1's none)."""
    assert run_gloo(_flag_columns_after_two_filters, 2) == [(4, [False, True, True, True]), (0, [])]
