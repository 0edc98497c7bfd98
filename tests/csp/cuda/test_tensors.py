"""csp.cuda.tensors: the one walker over nested items of tensors (map_tensors, iter_tensors)."""

from __future__ import annotations

import collections

import msgspec
import torch

from csp.cuda.tensors import Index, iter_tensors, map_tensors


class Msg(msgspec.Struct, frozen=True):
    hidden: torch.Tensor
    ids: list
    note: str = "n"


Pair = collections.namedtuple("Pair", "a b")


class Tagged(list):
    """A list subclass: its type must survive a map."""


def _item():
    a, b, c, d = (torch.full((2,), float(i)) for i in range(4))
    return {"msg": Msg(hidden=a, ids=[1, b, (c, "x")]), "pair": Pair(d, 7), "n": 3, "none": None}


def test_map_tensors_replaces_every_tensor_and_keeps_the_structure():
    item = _item()
    out = map_tensors(lambda t: t + 10, item)
    assert list(out) == ["msg", "pair", "n", "none"] and type(out) is dict
    assert type(out["msg"]) is Msg and out["msg"].note == "n"
    assert out["msg"].hidden.tolist() == [10.0, 10.0]
    assert out["msg"].ids[0] == 1 and out["msg"].ids[1].tolist() == [11.0, 11.0]
    assert type(out["msg"].ids[2]) is tuple and out["msg"].ids[2][0].tolist() == [12.0, 12.0]
    assert out["msg"].ids[2][1] == "x"
    assert type(out["pair"]) is Pair and out["pair"].a.tolist() == [13.0, 13.0] and out["pair"].b == 7
    assert out["n"] == 3 and out["none"] is None
    assert item["msg"].hidden.tolist() == [0.0, 0.0]  # the input is not changed


def test_map_tensors_preserves_list_and_tuple_subclasses():
    out = map_tensors(lambda t: t * 2, Tagged([torch.ones(1), "s"]))
    assert type(out) is Tagged and out[0].item() == 2.0 and out[1] == "s"


def test_map_tensors_copies_containers_unless_sharing_is_asked():
    """Default: every container is new, even one without tensors (a snapshot must not share the
    live optimizer's param_groups). share_unchanged: untouched containers come back as they are."""
    groups = [{"lr": 0.1}]
    state = {"groups": groups, "w": torch.zeros(1)}
    copied = map_tensors(lambda t: t.clone(), state)
    assert copied["groups"] == groups and copied["groups"] is not groups
    assert copied["groups"][0] is not groups[0]
    same = map_tensors(lambda t: t, state, share_unchanged=True)
    assert same is state
    moved = map_tensors(lambda t: t.clone(), state, share_unchanged=True)
    assert moved is not state and moved["groups"] is groups


def test_map_tensors_gives_paths_with_indexes_marked():
    seen = []
    map_tensors(lambda p, t: seen.append(p) or t, {"a": [torch.ones(1)], 0: Msg(torch.ones(1), [])},
                paths=True)
    assert seen == [("a", 0), (0, "hidden")]
    assert isinstance(seen[0][1], Index) and not isinstance(seen[1][0], Index)  # list position vs dict key
    assert map_tensors(lambda p, t: p, torch.ones(1), paths=True) == ()


def test_iter_tensors_visits_in_order_and_leaves_non_tensors_alone():
    item = _item()
    assert [t[0].item() for t in iter_tensors(item)] == [0.0, 1.0, 2.0, 3.0]
    paths = [p for p, _ in iter_tensors(item, paths=True)]
    assert paths == [("msg", "hidden"), ("msg", "ids", 1), ("msg", "ids", 2, 0), ("pair", 0)]
    assert list(iter_tensors([1, "two", None, b"x", {"k": 3.0}])) == []


def test_max_depth_stops_the_walk_and_keeps_deeper_containers():
    deep = [[[torch.ones(1)]]]
    assert list(iter_tensors(deep, max_depth=2)) == []
    assert len(list(iter_tensors(deep, max_depth=3))) == 1
    assert map_tensors(lambda t: t * 0, deep, max_depth=2, share_unchanged=True) is deep
    loop: list = []
    loop.append(loop)  # a self-referencing container ends at the limit
    assert list(iter_tensors(loop, max_depth=16)) == []


def test_opaque_objects_are_yielded_and_not_walked_into():
    class Sized(list):
        pass

    inner = torch.ones(1)
    box = Sized([inner])
    got = list(iter_tensors({"box": box, "t": torch.zeros(1)}, opaque=lambda o: isinstance(o, Sized)))
    assert got[0] is box and len(got) == 2 and got[1].item() == 0.0
