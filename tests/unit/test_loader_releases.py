"""Which loaders a constructor releases at (`constructor.releases.LoaderReleases`): loaders that
served earlier steps but not the one fetched now, every one at the end of data, until each is
told every step it served was handed or counts as gone. Pure: milliseconds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.constructor.releases import RELEASE_GIVE_UP, LoaderReleases


def test_a_loader_not_fetched_from_is_released_at_each_step_until_told_everything_it_served_was_handed() -> None:
    r = LoaderReleases()
    assert r.fetching(dict.fromkeys(["a", "b"], 0)) == []  # nothing held before
    assert r.fetching(dict.fromkeys(["a", "b"], 1)) == []
    assert r.fetching(dict.fromkeys(["a"], 2)) == ["b"]  # b served step 1, not step 2
    r.released("b", below=1, ok=True)  # the ranks are at step 1: b's step 1 is still needed
    assert r.held() == ["a", "b"]
    assert r.fetching(dict.fromkeys(["a"], 3)) == ["b"]  # released again with the next step built
    r.released("b", below=2, ok=True)  # every step b served (through 1) was handed
    assert r.held() == ["a"]
    assert r.fetching(dict.fromkeys(["a"], 4)) == []


def test_a_loader_fetched_from_again_is_held_through_its_new_step() -> None:
    r = LoaderReleases()
    r.fetching(dict.fromkeys(["a"], 0))
    assert r.fetching(dict.fromkeys(["b"], 1)) == ["a"]
    r.fetching(dict.fromkeys(["a"], 2))  # a replica serves again before its release answered
    r.released("a", below=1, ok=True)
    assert r.held() == ["a", "b"]  # it now holds step 2


def test_a_fetch_of_several_steps_holds_each_loader_through_the_furthest_step_it_served() -> None:
    """constructors.fetch_steps: one call per loader serves steps 4..6; a loader that held only
    step 4's samples is let go once told below 5, one that held step 6's only once told below 7."""
    r = LoaderReleases()
    r.fetching({"a": 4, "b": 6})
    r.released("a", below=5, ok=True)
    r.released("b", below=5, ok=True)
    assert r.held() == ["b"]
    r.released("b", below=7, ok=True)
    assert r.held() == []


def test_at_the_end_of_data_every_held_loader_is_released_and_dropped_once_told() -> None:
    """The end of the job: what every replica holds is let go, whatever step it last served."""
    r = LoaderReleases()
    r.fetching(dict.fromkeys(["a", "b"], 5))
    r.fetching(dict.fromkeys(["a", "c"], 6))
    assert r.held() == ["a", "b", "c"]
    for address in r.held():
        r.released(address, below=7, ok=True)
    assert r.held() == []


def test_a_loader_at_which_releases_keep_failing_is_given_up_and_a_success_resets_the_count() -> None:
    """test_restarts, part "loader": a replica killed and replaced answers no release again."""
    r = LoaderReleases(give_up=3)
    r.fetching(dict.fromkeys(["gone"], 0))
    r.fetching(dict.fromkeys([], 1))
    r.released("gone", below=0, ok=False)
    r.released("gone", below=0, ok=False)
    r.released("gone", below=0, ok=True)  # it answered (below 0: it still holds step 0)
    r.released("gone", below=0, ok=False)
    r.released("gone", below=0, ok=False)
    assert r.held() == ["gone"]
    r.released("gone", below=0, ok=False)  # three in a row
    assert r.held() == []
    r.released("gone", below=5, ok=True)  # a late answer changes nothing
    assert r.held() == [] and RELEASE_GIVE_UP > 3


@settings(max_examples=150, deadline=None)
@given(
    events=st.lists(
        st.tuples(
            st.dictionaries(st.sampled_from("abcd"), st.integers(0, 3), max_size=3),
            st.sampled_from("abcd"),
            st.integers(0, 12),
            st.booleans(),
        ),
        max_size=40,
    )
)
def test_a_loader_is_let_go_only_once_told_past_its_last_step_or_given_up(events) -> None:
    """Steps fetched in order from random loaders (each call serving up to 3 following steps
    too), with release answers in between: a loader is held exactly while no release past the
    furthest step fetched there last succeeded and fewer than `give_up` failed in a row since;
    a release is asked only of a held loader not fetched from."""
    r = LoaderReleases(give_up=2)
    last: dict[str, int] = {}
    failed: dict[str, int] = {}
    for step, (ahead, address, below, ok) in enumerate(events):
        fetched = {a: step + k for a, k in ahead.items()}
        release = r.fetching(fetched)
        assert set(release) == set(last) - set(fetched)
        last.update(fetched)
        r.released(address, below=below, ok=ok)
        if address in last:
            failed[address] = 0 if ok else failed.get(address, 0) + 1
            if (ok and below > last[address]) or failed[address] >= 2:
                del last[address], failed[address]
        assert r.held() == sorted(last)
