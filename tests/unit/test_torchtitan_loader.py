"""BatchplaneDataLoader's own logic over a stand-in client (no data plane, no sockets): the
pairs it yields, where it resumes (between steps and between microbatches, from any rank's
entry), that a saved state is marked in the data plane once training goes on, and what it
refuses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from batchplane.client import InvalidRequestError
from batchplane.client.torchtitan import BatchplaneDataLoader


def microbatch(step: int, index: int, *, ignore_id: int = -100) -> dict:
    ids = torch.tensor([[step, index, 7, 8]], dtype=torch.int32)
    return {
        "input_ids": ids,
        "labels": torch.tensor([[index, 7, 8, ignore_id]], dtype=torch.int32),
        "position_ids": torch.tensor([[0, 1, 2, 3]], dtype=torch.int32),
        "num_tokens": 4,
        "ignore_id": ignore_id,
    }


class FakeClient:
    """What the loader uses of `Client`: yields step s and then says next_step = s + 1."""

    def __init__(
        self, counts: list[int], *, dp: int = 2, cp: int = 1, microbatches: int = 2, ignore_id: int = -100, dp_rank: int = 0
    ) -> None:
        self.job = SimpleNamespace(mesh=SimpleNamespace(dp=dp, cp=cp, tp=1, pp=1), microbatches=microbatches)
        self.format = {"labels": "next_token", "ignore_id": ignore_id}
        self.steps = [[microbatch(s, i, ignore_id=ignore_id) for i in range(n)] for s, n in enumerate(counts)]
        self.dp_rank = dp_rank
        self.next_step = 0
        self.loaded: list[dict] = []
        self.marked: list[dict] = []

    def __iter__(self):
        while self.next_step < len(self.steps):
            step = self.next_step
            self.next_step = step + 1
            yield {"step": step, "rank": self.dp_rank, "dp_rank": self.dp_rank, "pp_rank": 0, "microbatches": self.steps[step]}

    def state_dict(self) -> dict:
        return {"version": 3, "job": "j", "fingerprints": {"data": "d"}, "rank": self.dp_rank, "next_step": self.next_step}

    def load_state_dict(self, state: dict) -> None:
        self.loaded.append(dict(state))
        self.next_step = state["next_step"]

    def checkpointed(self, state: dict) -> bool:
        self.marked.append(dict(state))
        return True

    def close(self) -> None:
        pass


def loader(client: FakeClient, *, per_step: int = 2, dp_rank: int = 0, **config) -> BatchplaneDataLoader:
    return BatchplaneDataLoader(
        BatchplaneDataLoader.Config(microbatches_per_step=per_step, **config), dp_world_size=2, dp_rank=dp_rank, client=client
    )


def first_ids(pair) -> tuple[int, int]:
    return tuple(pair[0]["input"][0, :2].tolist())


def test_pairs_are_torchtitans_input_dict_and_labels_in_int64_with_its_ignore_index() -> None:
    pairs = list(loader(FakeClient([2, 2], ignore_id=-1)))
    assert [first_ids(p) for p in pairs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    inputs, labels = pairs[1]
    assert sorted(inputs) == ["input", "positions"]
    assert inputs["input"].dtype == inputs["positions"].dtype == labels.dtype == torch.int64
    assert labels.tolist() == [[1, 7, 8, -100]]  # the job's ignore_id -1 becomes -100
    assert sorted(next(iter(loader(FakeClient([2]), positions=False)))[0]) == ["input"]


@pytest.mark.parametrize(
    ("taken", "position"),
    [(0, (0, 0)), (1, (0, 1)), (2, (1, 0)), (3, (1, 1)), (4, (2, 0))],
)
def test_the_state_names_the_next_microbatch_to_train_on(taken: int, position: tuple[int, int]) -> None:
    tt = loader(FakeClient([2, 2, 2]))
    it = iter(tt)
    for _ in range(taken):
        next(it)
    state = tt.state_dict()
    assert sorted(state) == ["dp_rank_0", "world_size"] and state["world_size"] == 2
    assert (state["dp_rank_0"]["next_step"], state["dp_rank_0"]["microbatch"]) == position


def test_a_mid_step_state_resumes_at_the_next_microbatch_from_any_ranks_entry() -> None:
    first = loader(FakeClient([2, 2, 2], dp_rank=1), dp_rank=1)
    it = iter(first)
    next(it), next(it), next(it)  # step 0 and the first microbatch of step 1
    saved = first.state_dict()
    assert "dp_rank_1" in saved
    again = loader(FakeClient([2, 2, 2]), dp_rank=0)  # rank 0 takes rank 1's entry
    again.load_state_dict(saved)
    assert (again.state_dict()["dp_rank_0"]["next_step"], again.state_dict()["dp_rank_0"]["microbatch"]) == (1, 1)
    assert [first_ids(p) for p in again] == [(1, 1), (2, 0), (2, 1)]


def test_a_saved_state_is_marked_at_the_next_microbatch_and_a_load_marks_nothing() -> None:
    client = FakeClient([2, 2, 2])
    tt = loader(client)
    it = iter(tt)
    next(it), next(it), next(it)  # step 0 and the first microbatch of step 1
    saved = tt.state_dict()["dp_rank_0"]
    assert client.marked == []  # not before training goes on: the save may still fail
    next(it)
    assert client.marked == [saved] and (saved["next_step"], saved["microbatch"]) == (1, 1)
    next(it)
    assert len(client.marked) == 1  # once
    tt.state_dict()  # DCP asks for the state to load into
    tt.load_state_dict({})
    list(it)
    assert len(client.marked) == 1


def test_an_iterator_started_again_inside_a_step_continues_with_its_next_microbatch() -> None:
    client = FakeClient([2, 2])
    tt = loader(client)
    it = iter(tt)
    next(it)
    assert [first_ids(p) for p in tt] == [(0, 1), (1, 0), (1, 1)]
    assert client.loaded[-1]["next_step"] == 0


@pytest.mark.parametrize(
    ("state", "expected_step"),
    [
        ({"dp_rank_1": {"next_step": 5}, "dp_rank_0": {"next_step": 4}, "world_size": 2}, 4),  # its own
        ({"dp_rank_3": {"next_step": 5}, "dp_rank_2": {"next_step": 6}, "world_size": 4}, 6),  # the lowest other
        ({"next_step": 3, "version": 3}, 3),  # a bare Client.state_dict()
    ],
)
def test_load_state_dict_takes_its_own_entry_else_any_other(state: dict, expected_step: int) -> None:
    client = FakeClient([2])
    loader(client).load_state_dict(state)
    assert client.loaded[-1]["next_step"] == expected_step and "microbatch" not in client.loaded[-1]


def test_an_empty_state_is_a_fresh_start_and_a_state_without_entry_is_refused() -> None:
    client = FakeClient([2])
    tt = loader(client)
    tt.load_state_dict({})
    assert client.loaded == []
    with pytest.raises(InvalidRequestError, match="no dp_rank_<i> entry"):
        tt.load_state_dict({"world_size": 2})


def test_a_mid_step_state_of_another_accumulation_is_refused() -> None:
    state = {"dp_rank_0": {"next_step": 1, "microbatch": 1, "microbatches_per_step": 3}}
    with pytest.raises(InvalidRequestError, match="microbatch 1 of 3 of a step; this loader takes 2"):
        loader(FakeClient([2])).load_state_dict(state)
    loader(FakeClient([2])).load_state_dict({"dp_rank_0": {**state["dp_rank_0"], "microbatch": 0}})  # a step boundary is fine


def test_a_step_with_another_number_of_microbatches_is_refused_before_any_of_it_is_yielded() -> None:
    it = iter(loader(FakeClient([2, 3, 2])))
    assert [first_ids(next(it)) for _ in range(2)] == [(0, 0), (0, 1)]
    with pytest.raises(InvalidRequestError, match="step 1 of the batchplane job has 3 microbatches .* torchtitan takes 2"):
        next(it)


@pytest.mark.parametrize(
    ("client", "dp_rank", "message"),
    [
        (FakeClient([2], dp=4), 0, "data-parallel degree is 2 but the batchplane job's mesh.dp is 4"),
        (FakeClient([2], cp=2), 0, "mesh.cp=2: torchtitan slices sequences"),
        (FakeClient([2], microbatches=1), 0, "batch.microbatches=1 per rank and step but torchtitan takes 2"),
    ],
)
def test_a_job_that_does_not_fit_the_trainer_is_refused_when_the_loader_is_built(client, dp_rank: int, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        loader(client, dp_rank=dp_rank)


def test_ranks_that_the_job_orders_differently_are_refused_at_the_first_step() -> None:
    with pytest.raises(InvalidRequestError, match="data-parallel rank 0 in torchtitan's mesh but 1 in the batchplane job's"):
        next(iter(loader(FakeClient([2], dp_rank=1), dp_rank=0)))


def test_a_stage_without_labels_is_refused_naming_it() -> None:
    client = FakeClient([2])
    for mb in client.steps[0]:
        del mb["labels"]
    with pytest.raises(InvalidRequestError, match="pipeline stage 0 receives no labels"):
        next(iter(loader(client)))


def test_microbatches_per_step_is_required() -> None:
    with pytest.raises(ValueError, match="microbatches_per_step must be >= 1"):
        loader(FakeClient([2]), per_step=0)
