"""The executor on real gloo processes: ragged tensors of several dtypes plus strings,
DP -> TP-group layout and back, byte accounting, zero bytes for the same layout."""

import os
import time

import numpy as np
import pytest
import torch

from distflow.coordinator.executor import GlobalView, PhaseTimes, TransferStats, _Assembler, pack, reshard, unpack
from distflow.coordinator.layout import Layout
from distflow.data.batch import Batch
from helpers import run_gloo

WORLD = 4


def _sample_batch(rank: int) -> tuple[Batch, list[int], list[int]]:
    """Rank r holds samples r, r+4, r+8, ...: values derived from the id so any mix-up shows."""
    ids = list(range(rank, 24, WORLD))
    lengths = [3 + (s * 7) % 11 for s in ids]
    width = max(lengths)  # each rank pads to its own width: ragged across ranks
    prompts = torch.zeros(len(ids), width, dtype=torch.int64)
    mask = torch.zeros(len(ids), width, dtype=torch.int64)
    for i, (s, n) in enumerate(zip(ids, lengths)):
        prompts[i, width - n:] = s * 1000 + torch.arange(n)
        mask[i, width - n:] = 1
    batch = Batch({"prompts": prompts, "prompt_mask": mask,
                   "advantages": torch.tensor(ids, dtype=torch.float32)[:, None] * torch.tensor([4.5, 45.0]),
                   "flag": torch.tensor([s % 2 == 0 for s in ids])},
                  {"ground_truth": [f"answer-{s}" for s in ids], "extra_info": [{"id": s} for s in ids]})
    return batch, ids, lengths


def _check_rows(batch: Batch, ids: list[int]) -> None:
    for i, s in enumerate(ids):
        n = 3 + (s * 7) % 11
        row = batch["prompts"][i][batch["prompt_mask"][i].bool()]
        assert row.tolist() == [s * 1000 + j for j in range(n)], (s, row)
        assert batch["advantages"][i].tolist() == [s * 4.5, s * 45.0]
        assert bool(batch["flag"][i]) == (s % 2 == 0)
        assert batch["ground_truth"][i] == f"answer-{s}" and batch["extra_info"][i] == {"id": s}


def _dp_to_tp_and_back(rank, world):
    batch, ids, lengths = _sample_batch(rank)
    dp, tp = Layout.data_parallel(world), Layout(world, tp_size=2)
    stats = TransferStats()
    to_tp, tp_ids, plan = reshard(batch, ids, lengths, dp, tp, stats=stats)
    _check_rows(to_tp, tp_ids)
    tp_lengths = [3 + (s * 7) % 11 for s in tp_ids]
    back, back_ids, _ = reshard(to_tp, tp_ids, tp_lengths, tp, dp, balance="none")
    _check_rows(back, back_ids)
    same = TransferStats()
    again, again_ids, same_plan = reshard(back, back_ids, [3 + (s * 7) % 11 for s in back_ids], dp, dp,
                                          balance="none", stats=same)
    assert torch.equal(again["prompts"], back["prompts"]) and again_ids == back_ids
    return {"tp_ids": tp_ids, "back_ids": back_ids, "stats": vars(stats), "same": vars(same),
            "moves": len(plan.moves), "same_moves": len(same_plan.moves)}


def test_dp_to_tp_groups_and_back():
    results = run_gloo(_dp_to_tp_and_back, WORLD)
    # TP replicas identical: ranks (0,1) and (2,3) hold the same samples
    assert results[0]["tp_ids"] == results[1]["tp_ids"] and results[2]["tp_ids"] == results[3]["tp_ids"]
    # nothing lost or duplicated across the two replicas
    assert sorted(results[0]["tp_ids"] + results[2]["tp_ids"]) == list(range(24))
    # back to DP: every sample on exactly one rank
    assert sorted(s for r in results for s in r["back_ids"]) == list(range(24))
    # the DP -> TP reshard really moved data and the counters agree across ranks
    sent = sum(r["stats"]["payload_sent"] for r in results)
    received = sum(r["stats"]["payload_received"] for r in results)
    assert sent == received > 0 and results[0]["moves"] > 0
    assert all(r["stats"]["meta_sent"] > 0 for r in results)
    # same layout: the local cache, zero payload bytes and no moves
    for r in results:
        assert r["same_moves"] == 0
        assert r["same"]["payload_sent"] == r["same"]["payload_received"] == 0


def _tp_group_split_in_place(rank, world):
    batch, ids, lengths = _sample_batch(rank)
    dp, tp = Layout.data_parallel(world), Layout(world, tp_size=2)
    to_tp, tp_ids, _ = reshard(batch, ids, lengths, dp, tp)
    stats = TransferStats()
    back, back_ids, plan = reshard(to_tp, tp_ids, [3 + (s * 7) % 11 for s in tp_ids], tp, dp, tolerance=0.25,
                                   stats=stats)
    _check_rows(back, back_ids)
    first = tp_ids.index(back_ids[0])
    return {"moves": len(plan.moves), "bytes": stats.payload_sent + stats.payload_received,
            "block": tp_ids[first: first + len(back_ids)] == back_ids,
            "views": all(back[k].untyped_storage().data_ptr() == to_tp[k].untyped_storage().data_ptr()
                         for k in back.tensors)}


def test_a_tp_group_split_among_its_members_hands_each_views_of_its_block():
    for r in run_gloo(_tp_group_split_in_place, WORLD):
        assert r == {"moves": 0, "bytes": 0, "block": True, "views": True}


def _with_and_without_a_view(rank, world):
    """DP -> TP -> DP twice: with one GlobalView (the second and third reshards skip the
    metadata all-gather) and without; then a view that no longer fits this rank's rows."""
    dp, tp = Layout.data_parallel(world), Layout(world, tp_size=2)
    length = lambda ids: [3 + (s * 7) % 11 for s in ids]  # noqa: E731
    out = {}
    for name, view in (("plain", None), ("view", GlobalView())):
        batch, ids, lengths = _sample_batch(rank)
        meta = []
        for src, dst in ((dp, tp), (tp, dp), (dp, tp)):
            stats = TransferStats()
            batch, ids, _ = reshard(batch, ids, length(ids), src, dst, stats=stats, view=view)
            meta.append(stats.meta_sent)
        _check_rows(batch, ids)
        out[name] = {"ids": ids, "prompts": batch["prompts"].tolist(), "meta": meta}
    batch, ids, lengths = _sample_batch(rank)
    try:
        reshard(batch, ids, lengths, dp, tp, view=view)  # the view records the TP layout's rows
    except ValueError as e:
        out["stale"] = str(e)
    return out


def test_a_global_view_replaces_the_metadata_all_gather_of_later_reshards():
    for r in run_gloo(_with_and_without_a_view, WORLD):
        assert r["view"]["ids"] == r["plain"]["ids"] and r["view"]["prompts"] == r["plain"]["prompts"]
        assert r["view"]["meta"][0] == r["plain"]["meta"][0]  # the first one gathers
        metadata = 8 * (1 + 2 * 6) * (WORLD - 1)  # the all-gather of 6 (id, length) pairs to 3 peers
        for plain, viewed in zip(r["plain"]["meta"][1:], r["view"]["meta"][1:]):
            assert plain - viewed >= metadata
        assert "the rows passed to reshard are not those its GlobalView records" in r["stale"]


def _labelled(rank, world):
    """DP -> TP -> DP with each sample's label (id mod 3) balanced on its own, with a
    GlobalView and without."""
    dp, tp = Layout.data_parallel(world), Layout(world, tp_size=2)
    length = lambda ids: [3 + (s * 7) % 11 for s in ids]  # noqa: E731
    out = {}
    for name, view in (("plain", None), ("view", GlobalView())):
        batch, ids, _ = _sample_batch(rank)
        meta, plans = [], []
        for src, dst in ((dp, tp), (tp, dp)):
            stats = TransferStats()
            batch, ids, plan = reshard(batch, ids, length(ids), src, dst, stats=stats, view=view,
                                       labels=[s % 3 for s in ids])
            meta.append(stats.meta_sent)
            plans.append(plan.assignment)
        _check_rows(batch, ids)
        out[name] = {"meta": meta, "plans": plans}
    return out


def test_labels_travel_with_the_metadata_and_the_view_keeps_them():
    from distflow.coordinator.planner import _validate, plan_samples

    dp, tp = Layout.data_parallel(WORLD), Layout(WORLD, tp_size=2)
    lengths = {s: 3 + (s * 7) % 11 for s in range(24)}
    table = _validate(dp, tp, {r: list(range(r, 24, WORLD)) for r in range(WORLD)}, lengths, "kk")
    first = plan_samples(dp, tp, table, labels=table.ids % 3)
    second = plan_samples(tp, dp, first.after, labels=table.ids % 3)
    assert first != plan_samples(dp, tp, table)  # the labels change the plan here
    for rank, r in enumerate(run_gloo(_labelled, WORLD)):
        assert r["plain"]["plans"] == r["view"]["plans"] == [first.assignment, second.assignment]
        # the second reshard's all-gather of this rank's (id, length, label) rows to 3 peers: the view has them
        triples = 8 * (1 + 3 * len(first.samples_for(rank))) * (WORLD - 1)
        assert r["view"]["meta"][0] == r["plain"]["meta"][0] and r["plain"]["meta"][1] - r["view"]["meta"][1] == triples


def test_pack_roundtrip_keeps_dtypes_shapes_and_strings():
    batch, ids, _ = _sample_batch(1)
    out, out_ids, head = unpack(pack(batch, [0, 2], [ids[0], ids[2]]))
    assert out_ids == [ids[0], ids[2]] and head > 8
    for k, v in batch.tensors.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v[[0, 2]])
    assert out["ground_truth"] == ["answer-1", "answer-9"]
    batch.meta["score"] = [np.int64(i) for i in range(len(batch))]  # a node's numpy scalars
    with pytest.raises(TypeError, match="meta field.s. score of the rows to send hold a value JSON cannot"):
        pack(batch, [0, 2], [ids[0], ids[2]])


def test_assembler_places_pieces_in_any_order_and_pads_like_concat():
    """Pieces of ragged widths arriving in any order (wider after narrower and the other
    way round, contiguous and scattered rows) give what concatenating and reordering gives."""
    gen = torch.Generator().manual_seed(0)
    for case in range(40):
        n = int(torch.randint(2, 12, (1,), generator=gen))
        ids = sorted(torch.randperm(100, generator=gen)[:n].tolist())
        order = torch.randperm(n, generator=gen).tolist()
        cuts = sorted(torch.randperm(n - 1, generator=gen)[:case % 3].add(1).tolist())
        groups = [sorted(order[a:b]) if case % 2 else order[a:b] for a, b in zip([0, *cuts], [*cuts, n])]
        pieces = []
        for rows in groups:
            width = int(torch.randint(1, 6, (1,), generator=gen))
            pieces.append((Batch({"prompts": torch.randint(1, 9, (len(rows), width), generator=gen),
                                  "responses": torch.rand(len(rows), width + 1, generator=gen),
                                  "scores": torch.rand(len(rows), generator=gen)},
                                 {"ground_truth": [f"gt-{ids[r]}" for r in rows]}), [ids[r] for r in rows]))
        assembler = _Assembler(ids)
        for piece, piece_ids in pieces:
            assembler.add(piece, piece_ids)
        got = assembler.result(0)
        whole = Batch.concat([p for p, _ in pieces])
        arrived = [s for _, piece_ids in pieces for s in piece_ids]
        expected = whole.select([arrived.index(s) for s in ids])
        assert set(got.tensors) == set(expected.tensors) and got.meta == expected.meta
        for k, v in expected.tensors.items():
            assert torch.equal(got[k], v), (case, k)
    # a field whose dtype differs between pieces (a user node's 0/1 rewards as int64 on one rank) is
    # promoted, whichever piece comes first and whether rows land as a block or scattered
    for first, second in ((0, 1), (1, 0)):
        pieces = [(Batch({"scores": torch.tensor([1, 0])}, {}), [1, 3]), (Batch({"scores": torch.tensor([0.5])}, {}), [2])]
        mixed = _Assembler([1, 2, 3])
        for piece, piece_ids in (pieces[first], pieces[second]):
            mixed.add(piece, piece_ids)
        assert mixed.result(0)["scores"].tolist() == [1.0, 0.5, 0.0]
    partial = _Assembler([1, 2, 3])
    partial.add(Batch({"scores": torch.ones(2)}, {}), [3, 1])
    with pytest.raises(AssertionError, match="assembled 2 of the 3 samples"):
        partial.result(0)
    for other in (Batch({"scores": torch.ones(1), "extra": torch.ones(1)}, {}), Batch({}, {}),
                  Batch({"scores": torch.ones(1)}, {"ground_truth": ["x"]})):
        with pytest.raises(ValueError, match="the pieces of one batch differ in their fields"):
            partial.add(other, [2])  # a field missing from one piece, or one more: never stale rows


def test_assembler_gathers_chosen_rows_of_a_piece_like_placing_their_selection():
    """`add(piece, ids, rows)` (the kept rows, gathered straight into place) gives what
    adding `piece.select(rows)` gives: scattered and contiguous rows, in and out of order
    of their positions, narrower than the widest piece."""
    gen = torch.Generator().manual_seed(1)
    ids = list(range(0, 40, 2))
    source = Batch({"prompts": torch.randint(1, 9, (30, 4), generator=gen),
                    "scores": torch.rand(30, generator=gen)}, {"ground_truth": [f"gt-{i}" for i in range(30)]})
    wider = Batch({"prompts": torch.randint(1, 9, (8, 6), generator=gen), "scores": torch.rand(8, generator=gen)},
                  {"ground_truth": [f"w-{i}" for i in range(8)]})
    for rows, spots in (([3, 9, 4, 20, 7, 11], list(range(6))), ([5, 6, 7, 8, 9, 10], list(range(6))),
                        ([2, 29, 13, 0, 17, 8], [0, 2, 5, 6, 9, 11])):
        placed = [ids[i] for i in spots]
        final = sorted(placed + [ids[i] for i in range(len(ids)) if i not in spots][:8])
        others = [s for s in final if s not in placed]
        for wider_first in (False, True):
            got, expected = _Assembler(final), _Assembler(final)
            if wider_first:
                got.add(wider, others), expected.add(wider, others)
            got.add(source, placed, rows)
            expected.add(source.select(rows), placed)
            if not wider_first:
                got.add(wider, others), expected.add(wider, others)
            got, expected = got.result(0), expected.result(0)
            assert got.meta == expected.meta
            for k in expected.tensors:
                assert torch.equal(got[k], expected[k]), (rows, wider_first, k)


def _held_batches(rank, world):
    """Reshards building batches of reused memory (every size pooled here): a batch
    still held is never handed out again; once dropped, its memory serves the next."""
    from distflow.coordinator import executor
    from distflow.coordinator.host_buffers import HostBuffers

    executor.BUFFERS = pool = HostBuffers(smallest=0)
    dp, tp = Layout.data_parallel(world), Layout(world, tp_size=2)
    length = lambda ids: [3 + (s * 7) % 11 for s in ids]  # noqa: E731
    batch, ids, lengths = _sample_batch(rank)
    held, held_ids, _ = reshard(batch, ids, lengths, dp, tp)
    snapshot = {k: v.clone() for k, v in held.tensors.items()}
    back, back_ids, _ = reshard(held, held_ids, length(held_ids), tp, dp)
    again, again_ids, _ = reshard(back, back_ids, length(back_ids), dp, tp)
    _check_rows(again, again_ids)
    intact = all(torch.equal(held[k], v) for k, v in snapshot.items())
    distinct = held["prompts"].data_ptr() != again["prompts"].data_ptr()
    mappings = len(pool.mappings)
    del held, back, snapshot
    later, later_ids, _ = reshard(again, again_ids, length(again_ids), tp, dp)
    again, again_ids, _ = reshard(later, later_ids, length(later_ids), dp, tp)
    _check_rows(again, again_ids)
    return {"intact": intact, "distinct": distinct, "reused": len(pool.mappings) == mappings}


def test_a_held_batch_keeps_its_memory_and_a_dropped_one_serves_the_next():
    for r in run_gloo(_held_batches, WORLD):
        assert r == {"intact": True, "distinct": True, "reused": True}


def _too_few(rank, world):
    batch, ids, lengths = _sample_batch(rank)
    keep = 1 if rank == 0 else 0  # only one sample in total, two DP replicas
    try:
        reshard(batch.select(list(range(keep))), ids[:keep], lengths[:keep],
                Layout.data_parallel(world), Layout(world, tp_size=2))
    except ValueError as e:
        return str(e)
    return None


def _leftover_files(world, *dirs) -> list[str]:
    """This group's shared-memory files still named in `dirs` (other tests' groups, running
    beside this one, have files of their own)."""
    import os

    from distflow.coordinator import executor

    prefix = f"distflow-{executor._group_state(None, world).token}-"
    return [f for d in dirs if d and os.path.isdir(d) for f in os.listdir(d) if f.startswith(prefix)]


def _both_transports(rank, world, separate_hosts):
    import os

    if separate_hosts:
        os.environ["DISTFLOW_HOST_ID"] = f"host-{rank}"
    batch, ids, lengths = _sample_batch(rank)
    results = {}
    for transport in ("gloo", "auto"):
        stats = TransferStats()
        out, out_ids, _ = reshard(batch, ids, lengths, Layout.data_parallel(world), Layout(world, tp_size=2),
                                  stats=stats, transport=transport)
        _check_rows(out, out_ids)
        results[transport] = (out_ids, out["prompts"].tolist(), stats.shm_sent, stats.payload_sent)
    return results, _leftover_files(world, "/dev/shm")


def test_every_rank_its_own_host_means_no_shared_memory():
    for r, leftovers in run_gloo(_both_transports, WORLD, True):
        assert r["auto"][2] == 0 and r["gloo"][:2] == r["auto"][:2]
        assert not leftovers, leftovers


def _rounds(rank, world, small_shm):
    """Several reshards in a row, growing, through reused shared-memory slots; then
    messages over the size that keeps a slot; then with a /dev/shm too small for the
    payload."""
    from distflow.coordinator import executor

    state = executor._group_state(None, world)
    out = []
    rounds = [(None, False), (None, False), (None, False), (None, True), (small_shm, False)]
    for rnd, (shm_dir, over_keep) in enumerate(rounds):
        if shm_dir is not None:
            executor._SHM_DIR = shm_dir
        kept = (dict(state.send), dict(state.recv))
        executor._KEEP_SLOT_BYTES = 1024 if over_keep else 64 << 20
        batch, ids, lengths = _sample_batch(rank)
        width = 64 << (2 * rnd)  # 64 .. 4096 floats: every slot has to grow
        batch.tensors["wide"] = torch.tensor(ids, dtype=torch.float32)[:, None] + torch.arange(width) / width
        got = {}
        for transport in ("auto", "gloo"):
            stats = TransferStats()
            tp_batch, tp_ids, _ = reshard(batch, ids, lengths, Layout(world), Layout(world, tp_size=2),
                                          stats=stats, transport=transport)
            back, back_ids, _ = reshard(tp_batch, tp_ids, [3 + (s * 7) % 11 for s in tp_ids],
                                        Layout(world, tp_size=2), Layout(world), stats=stats, transport=transport)
            for b, i in ((tp_batch, tp_ids), (back, back_ids)):
                _check_rows(b, i)
                assert torch.equal(b["wide"], torch.tensor(i, dtype=torch.float32)[:, None]
                                   + torch.arange(width) / width)
            got[transport] = (tp_ids, back_ids, tp_batch["wide"].tolist(), stats.shm_sent, stats.payload_sent)
        assert got["auto"][:3] == got["gloo"][:3]  # one host: shared memory and sockets agree
        # over the size: files of their own, which neither side keeps
        out.append({"shm_sent": got["auto"][3], "payload": got["auto"][4],
                    "slots_unchanged": (dict(state.send), dict(state.recv)) == kept})
    return out, _leftover_files(world, "/dev/shm", small_shm), _too_few(rank, world)


def test_reused_slots_a_full_shm_and_an_unsatisfiable_plan(tmp_path):
    """Also: an unsatisfiable plan fails on every rank alike, before any transfer."""
    import subprocess

    small = tmp_path / "shm"
    small.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], capture_output=True).returncode == 0
    try:
        results = run_gloo(_rounds, WORLD, str(small) if mounted else None)
    finally:
        if mounted:
            subprocess.run(["umount", str(small)], check=True)
    for rounds, leftovers, too_few in results:
        assert too_few is not None and "1 samples cannot fill the 2 destination" in too_few, too_few
        assert not leftovers, leftovers  # names are unlinked once mapped
        assert all(r["payload"] > 0 for r in rounds)
        assert all(r["shm_sent"] > 0 for r in rounds[:4])
        assert all(r["shm_sent"] == r["payload"] for r in rounds[:4])  # one host: all of it (not the headers too)
        assert not rounds[2]["slots_unchanged"] and rounds[3]["slots_unchanged"]  # round 2 grew them
        if mounted:  # 64 KiB of /dev/shm cannot hold the last round: it went over the wire
            assert rounds[4]["shm_sent"] < rounds[4]["payload"]


def test_phase_times_count_a_wait_in_seconds_and_work_in_cpu():
    """A phase that waits takes seconds but almost no CPU of the calling thread; one that
    computes takes both; repeated phases add up."""
    times = PhaseTimes()
    with times("sizes"):
        time.sleep(0.05)
    for _ in range(2):
        with times("plan"):
            deadline = time.thread_time() + 0.02
            while time.thread_time() < deadline:
                pass
    assert times["sizes"] >= 0.05 and times.cpu["sizes"] < 0.01
    assert times.cpu["plan"] >= 0.04 and times["plan"] >= 0.04 * 0.99  # two clocks: allow their granularity


def test_slot_files_of_dead_writers_are_swept_and_untaken_ones_unlinked_at_exit(tmp_path, monkeypatch):
    """A reshard whose reader died left its writer's slot file in /dev/shm (memory) until
    reboot: a process unlinks the ones no reader took when it exits, and a new group
    removes those whose writer was killed outright."""
    import subprocess
    import sys

    from distflow.coordinator import executor

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    names = {"dead": f"distflow-123-{dead}-0-1-0-1", "alive": f"distflow-123-{os.getpid()}-0-1-0-1",
             "floor": "distflow-floor-123-prepared-0-0-1"}
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    monkeypatch.setattr(executor, "_SHM_DIR", str(tmp_path))
    executor._sweep_dead_writers()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names["alive"], names["floor"]])
    untaken = tmp_path / "untaken"
    subprocess.run([sys.executable, "-c", f"from distflow.coordinator import executor; open({str(untaken)!r}, 'w'); "
                    f"executor._WRITTEN.add({str(untaken)!r})"], check=True, timeout=120)
    assert not untaken.exists()
