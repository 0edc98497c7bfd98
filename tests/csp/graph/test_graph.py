"""Graph files, overrides, the kind registry and validation: every user error is a GraphError that
names the file, the msgspec path or the graph node to fix."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Optional, Union

import msgspec
import pytest

import csp
from csp.graph import apply_override, compatible

pytestmark = pytest.mark.timeout(20)


class Base:
    pass


class Derived(Base):
    pass


class Emit(csp.Process):
    outputs = {"out": Derived}

    def run(self, inputs, outputs):  # pragma: no cover - never run here
        pass


class Take(csp.Process):
    class Options(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
        top: int = 3

    inputs = {"inp": Base}

    def run(self, inputs, outputs):  # pragma: no cover
        pass


class TakeStr(csp.Process):
    inputs = {"inp": str}

    def run(self, inputs, outputs):  # pragma: no cover
        pass


class AsyncTake(csp.Process):
    inputs = {"inp": object}

    async def run(self, inputs, outputs):  # pragma: no cover
        pass


@pytest.fixture
def reg() -> csp.Registry:
    r = csp.Registry(entry_point_group=None)
    r.register("t.emit", Emit)
    r.register("t.take", Take)
    r.register("t.take_str", TakeStr)
    return r


GOOD = """
[[channel]]
name = "items"
capacity = 4

[[process]]
name = "emit"
kind = "t.emit"
outputs = { out = "items" }

[[process]]
name = "take"
kind = "t.take"
replicas = 2
inputs = { inp = "items" }
[process.options]
top = 5
"""


def write(tmp_path: Path, text: str, name: str = "graph.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# -- TOML loading -----------------------------------------------------------------------------

def test_good_file_loads_and_builds(tmp_path, reg):
    spec = csp.load_spec(write(tmp_path, GOOD))
    graph = csp.Graph.from_spec(spec, reg)
    assert graph.channels["items"].capacity == 4
    take = graph.processes["take"]
    assert take.replicas == 2 and take.options.top == 5 and take.devices == [None, None]


def test_unknown_key_names_file_and_path(tmp_path):
    path = write(tmp_path, GOOD.replace("capacity = 4", "capactiy = 4"))
    with pytest.raises(csp.GraphError, match=r"graph\.toml: Object contains unknown field `capactiy` - at `\$\.channel\[0\]`"):
        csp.load_spec(path)


def test_wrong_type_and_limit(tmp_path):
    with pytest.raises(csp.GraphError, match=r"Expected `int`, got `str` - at `\$\.process\[1\]\.replicas`"):
        csp.load_spec(write(tmp_path, GOOD.replace("replicas = 2", 'replicas = "two"')))
    with pytest.raises(csp.GraphError, match=r">= 1 - at `\$\.process\[1\]\.replicas`"):
        csp.load_spec(write(tmp_path, GOOD.replace("replicas = 2", "replicas = 0")))


def test_missing_capacity_is_an_error(tmp_path):
    with pytest.raises(csp.GraphError, match=r"missing required field `capacity` - at `\$\.channel\[0\]`"):
        csp.load_spec(write(tmp_path, GOOD.replace("capacity = 4", "")))


def test_missing_file(tmp_path):
    with pytest.raises(csp.GraphError, match=r"nope\.toml: graph file not found"):
        csp.load_spec(tmp_path / "nope.toml")


def test_bad_syntax(tmp_path):
    with pytest.raises(csp.GraphError, match=r"graph\.toml: invalid TOML: .*line 3"):
        csp.load_spec(write(tmp_path, "[[channel]]\nname = 'x'\ncapacity = = 3\n"))


def test_a_graph_file_with_a_utf8_byte_order_mark_loads(tmp_path):
    """Invariant: a graph file saved with a UTF-8 byte-order mark reads as without it."""
    path = tmp_path / "graph.toml"
    path.write_bytes(b"\xef\xbb\xbf" + textwrap.dedent(GOOD).lstrip().encode())
    assert csp.load_spec(path) == csp.load_spec(write(tmp_path, GOOD, "plain.toml"))


def test_a_dflash_graph_file_with_a_utf8_byte_order_mark_loads(tmp_path):
    """Invariant: dflash.run reads its graph through the same loader: a BOM is accepted."""
    from dflash.run.config import load_config

    example = Path(__file__).resolve().parents[3] / "examples" / "dflash-tiny.toml"
    path = tmp_path / "dflash-tiny.toml"  # run.name is the file's name (the example sets none)
    path.write_bytes(b"\xef\xbb\xbf" + example.read_bytes())
    assert load_config(path).run.name == "dflash-tiny"


def test_csp_run_on_a_dflash_graph_points_to_dflash_run(capsys):
    """Invariant: ``python -m csp.run`` on a DFlash graph file refuses its [run] table (exit 2) in
    one line that says to run it with ``python -m dflash.run GRAPH``."""
    from csp.run import main

    graph = str(Path(__file__).resolve().parents[3] / "examples" / "dflash-tiny.toml")
    assert main([graph, "--no-run-dir"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown field `run`" in err
    assert err.rstrip().endswith(f"run this one with python -m dflash.run {graph}"), err


def test_csp_run_other_unknown_fields_get_no_dflash_hint(tmp_path, capsys):
    """Invariant: an unknown top-level table DFlash does not have, or a DFlash table set by --set,
    is the plain unknown-field error."""
    from csp.run import main

    assert main([str(write(tmp_path, GOOD + "\n[bogus]\nx = 1\n")), "--no-run-dir"]) == 2
    assert capsys.readouterr().err.rstrip().endswith("unknown field `bogus`")
    assert main([str(write(tmp_path, GOOD)), "--no-run-dir", "--set", "run.steps=3"]) == 2
    assert "dflash.run" not in capsys.readouterr().err


def test_csp_run_knows_the_dflash_tables():
    """Invariant: csp.run's list of DFlash tables is the DFlash graph schema's own top-level
    tables beyond csp's (csp cannot import dflash to read it)."""
    from csp.run import DFLASH_TABLES
    from dflash.run.config import DFlashFile

    assert set(DFLASH_TABLES) == set(DFlashFile.__struct_fields__) - set(csp.GraphSpec.__struct_fields__)


def test_unknown_option_key_path(tmp_path, reg):
    spec = csp.load_spec(write(tmp_path, GOOD.replace("top = 5", "tpo = 5")))
    with pytest.raises(csp.GraphError, match=r"process 'take': options: Object contains unknown field `tpo` - at `\$\.process\[1\]\.options`"):
        csp.Graph.from_spec(spec, reg)


def test_wrong_option_type_path(tmp_path, reg):
    spec = csp.load_spec(write(tmp_path, GOOD.replace("top = 5", 'top = "5"')))
    with pytest.raises(csp.GraphError, match=r"- at `\$\.process\[1\]\.options\.top`"):
        csp.Graph.from_spec(spec, reg)


class RunSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    seed: int = 0


class AppFile(csp.GraphSpec):
    run: RunSection


def test_application_subclass_adds_tables(tmp_path):
    spec = csp.load_spec(write(tmp_path, '[run]\nname = "x"\n' + GOOD), AppFile, ["run.seed=7"])
    assert spec.run.name == "x" and spec.run.seed == 7 and len(spec.process) == 2
    with pytest.raises(csp.GraphError, match=r"unknown field `sede` - at `\$\.run`"):
        csp.load_spec(write(tmp_path, '[run]\nname = "x"\nsede = 1\n' + GOOD), AppFile)


# -- overrides --------------------------------------------------------------------------------

def test_overrides_address_tables_by_name(tmp_path):
    spec = csp.load_spec(write(tmp_path, GOOD), overrides=[
        "process.take.replicas=1", "channel.items.capacity=0", "trace.flows=true",
        "process.take.options.top=9", "process.emit.device=cpu", "channel.items.ordered = true",
    ])
    assert spec.process[1].replicas == 1 and spec.process[1].options == {"top": 9}
    assert spec.channel[0].capacity == 0 and spec.channel[0].ordered is True
    assert spec.trace.flows is True
    assert spec.process[0].device == "cpu"  # not TOML: taken as a string


@pytest.mark.parametrize("override, message", [
    ("process.take.replicas", "expected dotted.key=value"),
    ("process..replicas=1", "expected dotted.key=value"),
    ("process.tkae.replicas=1", r"no \[\[process\]\] named 'tkae' \(known: \['emit', 'take'\]\)"),
    ("process.take=1", "give a field of process.take"),
    ("channel.items.capacity.x=1", "is a value, not a table"),
])
def test_bad_overrides(tmp_path, override, message):
    with pytest.raises(csp.GraphError, match=message):
        csp.load_spec(write(tmp_path, GOOD), overrides=[override])


def test_override_with_unknown_field_is_caught_by_decoding(tmp_path):
    with pytest.raises(csp.GraphError, match=r"unknown field `capactiy` - at `\$\.channel\[0\]`"):
        csp.load_spec(write(tmp_path, GOOD), overrides=["channel.items.capactiy=2"])


def test_apply_override_creates_missing_tables():
    data: dict[str, Any] = {}
    apply_override(data, "trace.stats_interval_s=0.5")
    assert data == {"trace": {"stats_interval_s": 0.5}}


@pytest.mark.parametrize("override, note", [
    ("process.take.options.top=-1", None),            # options are decoded later, by from_spec
    ("channel.items.capacity=-1", "channel.items.capacity=-1"),
    ("channel.items.capactiy=2", "channel.items.capactiy=2"),
    ("trace.floes=true", "trace.floes=true"),
    ("nosuch.key=1", "nosuch.key=1"),
])
def test_override_errors_name_the_override(tmp_path, override, note):
    """Regression: an error caused by ``--set`` was labelled with the file only; it now names the
    override that set the offending key (and only that one)."""
    overrides = ["process.take.replicas=1", override]
    if note is None:
        csp.load_spec(write(tmp_path, GOOD), overrides=overrides)
        return
    with pytest.raises(csp.GraphError) as info:
        csp.load_spec(write(tmp_path, GOOD), overrides=overrides)
    assert str(info.value).endswith(f"(from --set {note})") and "graph.toml" in str(info.value)


def test_file_error_is_not_blamed_on_an_override(tmp_path):
    bad = GOOD.replace("capacity = 4", "capacity = -4")
    with pytest.raises(csp.GraphError) as info:
        csp.load_spec(write(tmp_path, bad), overrides=["process.take.replicas=1", "trace.flows=true"])
    assert "$.channel[0].capacity" in str(info.value) and "--set" not in str(info.value)


def test_apply_override_returns_the_msgspec_path():
    data: dict[str, Any] = {"process": [{"name": "a"}, {"name": "b"}]}
    assert apply_override(data, "process.b.options.top=1") == "$.process[1].options.top"
    assert apply_override(data, "run.steps=3") == "$.run.steps"


# -- registry ---------------------------------------------------------------------------------

def test_unknown_kind_lists_known_and_close_matches(tmp_path, reg):
    spec = csp.load_spec(write(tmp_path, GOOD.replace('kind = "t.take"', 'kind = "t.tkae"')))
    with pytest.raises(csp.GraphError) as info:
        csp.Graph.from_spec(spec, reg)
    msg = str(info.value)
    assert "process 'take' ($.process[1].kind)" in msg and "unknown process kind 't.tkae'" in msg
    assert "Did you mean 't.take'" in msg and "t.emit, t.take, t.take_str" in msg


def test_import_strings_need_opt_in(reg):
    kind = f"{__name__}:Take"
    with pytest.raises(csp.GraphError, match="import strings are off by default"):
        reg.resolve(kind)
    assert reg.resolve(kind, allow_imports=True) is Take
    with pytest.raises(csp.GraphError, match="not a csp.Process subclass"):
        reg.resolve(f"{__name__}:Base", allow_imports=True)
    with pytest.raises(csp.GraphError, match="cannot import kind"):
        reg.resolve("no_such_module_xyz:Thing", allow_imports=True)


def test_register_rejects_conflicts_and_non_processes(reg):
    reg.register("t.take", Take)  # same class again: fine
    with pytest.raises(ValueError, match="already registered"):
        reg.register("t.take", TakeStr)
    with pytest.raises(TypeError, match="not a csp.Process subclass"):
        reg.register("t.base", Base)
    with pytest.raises(ValueError, match="invalid kind"):
        reg.register("a:b", Take)


def test_decorator_registers_in_default_registry():
    @csp.register("tests.graph.decorated")
    class Decorated(csp.Process):
        def run(self, inputs, outputs):  # pragma: no cover
            pass

    assert csp.registry.resolve("tests.graph.decorated") is Decorated


def test_plugins_import_and_failure(tmp_path):
    spec = csp.load_spec(write(tmp_path, 'plugins = ["no_such_plugin_xyz"]\n' + GOOD))
    with pytest.raises(csp.GraphError, match="plugins: cannot import 'no_such_plugin_xyz'"):
        csp.Graph.from_spec(spec)


def test_plugins_found_next_to_the_graph_file(tmp_path, monkeypatch):
    """Regression: ``python -m csp.run /abs/path/examples/x.toml`` from another directory could
    not import ``examples.textpipe``. Invariant: a plugin package in the graph file's directory or
    a parent is imported from there, and sys.path is left as it was."""
    import sys

    pkg = tmp_path / "proj" / "qa_plug_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "kinds.py").write_text(textwrap.dedent("""
        import csp

        @csp.register("qa_plug_pkg.emit")
        class Emit(csp.Process):
            outputs = {"out": object}

            def run(self, inputs, outputs):
                pass

        @csp.register("qa_plug_pkg.take")
        class Take(csp.Process):
            class Options(csp.Process.Options):
                top: int = 3

            inputs = {"inp": object}

            def run(self, inputs, outputs):
                pass
    """))
    graphs = tmp_path / "proj" / "graphs"
    graphs.mkdir()
    text = 'plugins = ["qa_plug_pkg.kinds"]\n' + GOOD.replace('"t.', '"qa_plug_pkg.')
    monkeypatch.chdir(tmp_path)
    path_before = list(sys.path)
    try:
        spec = csp.load_spec(write(graphs, text))
        assert sys.path == path_before
        assert "qa_plug_pkg.kinds" in sys.modules
        assert csp.Graph.from_spec(spec).processes["emit"].cls.__module__ == "qa_plug_pkg.kinds"
    finally:
        for name in ("qa_plug_pkg.kinds", "qa_plug_pkg"):
            sys.modules.pop(name, None)
    spec = csp.load_spec(write(graphs, text.replace("qa_plug_pkg.kinds", "qa_plug_pkg.nope")))
    with pytest.raises(csp.GraphError, match="cannot import 'qa_plug_pkg.nope'.*PYTHONPATH"):
        csp.Graph.from_spec(spec)
    for name in ("qa_plug_pkg",):
        sys.modules.pop(name, None)


# -- validation -------------------------------------------------------------------------------

def test_builder_graph_validates():
    g = csp.Graph().channel("items", capacity=2)
    g.process("emit", Emit, outputs={"out": "items"}).process("take", Take, inputs={"inp": "items"},
                                                                options={"top": 1})
    g.validate()
    assert g.item_type("items") is Derived


@pytest.mark.parametrize("make, message", [
    (lambda g: g.channel("items", capacity=1).process("emit", Emit, outputs={"out": "items"})
        .process("take", Take, inputs={}),
     r"process 'take': input port 'inp' is not connected"),
    (lambda g: g.channel("items", capacity=1).process("emit", Emit, outputs={"out": "items"})
        .process("take", Take, inputs={"inp": "items", "extra": "items"}),
     r"process 'take': Take has no input port 'extra'"),
    (lambda g: g.channel("items", capacity=1).process("emit", Emit, outputs={"out": "items"})
        .process("take", Take, inputs={"inp": "itmes"}),
     r"process 'take': input port 'inp' is connected to unknown channel 'itmes'"),
    (lambda g: g.channel("items", capacity=1).channel("spare", capacity=1)
        .process("emit", Emit, outputs={"out": "items"}).process("take", Take, inputs={"inp": "items"}),
     r"channel 'spare' has no sender"),
    (lambda g: g.channel("items", capacity=1).process("emit", Emit, outputs={"out": "items"}),
     r"channel 'items' has no receiver"),
    (lambda g: g.channel("items", capacity=1).process("emit", Emit, outputs={"out": "items"})
        .process("take", TakeStr, inputs={"inp": "items"}),
     r"channel 'items': process 'emit' sends Derived \(port 'out'\) but process 'take' receives str"),
    (lambda g: g.channel("items", capacity=1).process("emit", Emit, outputs={"out": "items"})
        .process("take", Take, inputs={"inp": "items"}, device="cuda:99"),
     r"process 'take': device 'cuda:99' does not exist"),
    (lambda g: g.channel("items", capacity=1).process("emit", Emit, outputs={"out": "items"})
        .process("take", Take, inputs={"inp": "items"}, device="gpu0"),
     r"process 'take': device 'gpu0' is not 'cpu', 'cuda' or 'cuda:N'"),
])
def test_validation_errors(make, message):
    g = csp.Graph()
    make(g)
    with pytest.raises(csp.GraphError, match=message):
        g.validate()


class EmitWithTap(csp.Process):
    """Sends 0..4 on ``out``, and each also on ``tap`` when the graph connects it."""

    outputs = {"out": int, "tap": int}
    optional = frozenset({"tap"})

    def run(self, inputs, outputs):
        for i in range(5):
            outputs["out"].send(i)
            if "tap" in outputs:
                outputs["tap"].send(i * 10)


class Collect(csp.Process):
    """Collects ``inp`` (and ``extra`` when connected) into the app's lists."""

    inputs = {"inp": int, "extra": int}
    optional = frozenset({"extra"})

    def run(self, inputs, outputs):
        self.ctx.app.setdefault(self.ctx.name, []).extend(inputs.get("extra") or inputs["inp"])


def test_an_optional_port_may_be_left_out_and_works_when_connected():
    """Invariant: a port the class lists in ``optional`` may stay unconnected (the process then
    finds no entry for it); connected, it carries items like any port; a required port left out
    is still an error."""
    got: dict = {}
    g = csp.Graph().channel("items", capacity=2)
    g.process("emit", EmitWithTap, outputs={"out": "items"}).process("take", Collect, inputs={"inp": "items"})
    csp.Runtime(g, app=got).run()
    assert got == {"take": [0, 1, 2, 3, 4]}
    got.clear()
    g = csp.Graph().channel("items", capacity=2).channel("taps", capacity=2)
    g.process("emit", EmitWithTap, outputs={"out": "items", "tap": "taps"})
    g.process("take", Collect, inputs={"inp": "items"}).process("tap", Collect, inputs={"inp": "taps"})
    csp.Runtime(g, app=got).run()
    assert got == {"take": [0, 1, 2, 3, 4], "tap": [0, 10, 20, 30, 40]}
    g = csp.Graph().channel("items", capacity=2)
    g.process("emit", EmitWithTap, outputs={"tap": "items"}).process("take", Collect, inputs={"inp": "items"})
    with pytest.raises(csp.GraphError, match="process 'emit': output port 'out' is not connected"):
        g.validate()


def test_cuda_means_cuda_0_and_is_ambiguous_for_several_replicas():
    """Regression: ``device = "cuda"`` was rejected, needing "cuda:N". Invariant: "cuda"
    is stored as "cuda:0" (torch's meaning without set_device) for one replica and in a
    ``devices`` list; ``device = "cuda"`` for several replicas is one error saying what to write
    (all on GPU 0, or one GPU each), since either reading is plausible."""
    g = csp.Graph().channel("items", capacity=1)
    g.process("take", Take, inputs={"inp": "items"}, device="cuda")
    g.process("pair", Take, inputs={"inp": "items"}, replicas=2, devices=["cuda", "cuda:1"])
    assert g.processes["take"].devices == ["cuda:0"]
    assert g.processes["pair"].devices == ["cuda:0", "cuda:1"]
    with pytest.raises(csp.GraphError, match=r"process 'many': device = \"cuda\" for 3 replicas is ambiguous; "
                       r"write device = \"cuda:0\" \(every replica on GPU 0\) or devices = "):
        g.process("many", Take, inputs={"inp": "items"}, replicas=3, device="cuda")


def test_builder_errors_name_the_node():
    g = csp.Graph().channel("items", capacity=1)
    with pytest.raises(csp.GraphError, match="channel 'items' is declared twice"):
        g.channel("items", capacity=1)
    g.process("take", Take, inputs={"inp": "items"})
    with pytest.raises(csp.GraphError, match="process 'take' is declared twice"):
        g.process("take", Take, inputs={"inp": "items"})
    with pytest.raises(csp.GraphError, match=r"process 't2': 3 devices for 2 replicas"):
        g.process("t2", Take, replicas=2, devices=["cpu", "cpu", "cpu"])
    with pytest.raises(csp.GraphError, match="process 't3': give either device"):
        g.process("t3", Take, device="cpu", devices=["cpu"])
    with pytest.raises(csp.GraphError, match=r"process 't4': options: .* - at `\$\.process\[1\]\.options`"):
        g.process("t4", Take, options={"nope": 1})
    with pytest.raises(csp.GraphError, match="process 't5': .* is not a csp.Process subclass"):
        g.process("t5", Base)


def test_devices_list_in_toml_checked_against_replicas(tmp_path, reg):
    text = GOOD.replace("replicas = 2", 'replicas = 2\ndevices = ["cpu"]')
    spec = csp.load_spec(write(tmp_path, text))
    with pytest.raises(csp.GraphError, match=r"process 'take': 1 devices for 2 replicas"):
        csp.Graph.from_spec(spec, reg)


@pytest.mark.gpu
def test_async_process_cannot_take_cuda():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (cuda:0 must exist to reach the async check)")
    g = csp.Graph().channel("items", capacity=1).process("emit", Emit, outputs={"out": "items"})
    g.process("take", AsyncTake, inputs={"inp": "items"}, device="cuda:0")
    with pytest.raises(csp.GraphError, match="async process cannot be bound to a CUDA device"):
        g.validate()


def test_cpu_devices_always_exist():
    g = csp.Graph().channel("items", capacity=1).process("emit", Emit, outputs={"out": "items"})
    g.process("take", Take, inputs={"inp": "items"}, replicas=2, devices=["cpu", "cpu"])
    g.validate()


def test_type_compatibility_rules():
    assert compatible(Derived, Base) and not compatible(Base, Derived)
    assert compatible(int, object) and compatible(object, int) and compatible(int, Any)
    assert compatible(int, Optional[int]) and compatible(int, Union[str, int])
    assert compatible(int | None, int | str | None) and not compatible(int | bytes, int | str)
    assert compatible(list[int], list) and compatible(list[int], list[str])  # origins only
    assert not compatible(dict[str, int], list)


class Relay(csp.Process):
    inputs = {"inp": object}
    outputs = {"out": object}

    def run(self, inputs, outputs):  # pragma: no cover
        pass


class Join(csp.Process):
    inputs = {"a": object, "b": object}
    outputs = {"out": object}

    def run(self, inputs, outputs):  # pragma: no cover
        pass


def test_self_loop_is_rejected_naming_the_channel():
    """Invariant: a process that receives from a channel it sends to (which never closes, so the
    run hangs) is rejected at validation, naming the channel, the process and both ports, even
    when a source feeds the process too."""
    g = csp.Graph().channel("items", capacity=1).channel("loop", capacity=1)
    g.process("emit", Emit, outputs={"out": "items"})
    g.process("join", Join, inputs={"a": "items", "b": "loop"}, outputs={"out": "loop"})
    with pytest.raises(csp.GraphError, match=r"channel 'loop' is a self-loop: process 'join' sends "
                                             r"to it \(port 'out'\) and receives from it \(port 'b'\)"):
        g.validate()
    alone = csp.Graph().channel("loop", capacity=0)
    alone.process("relay", Relay, inputs={"inp": "loop"}, outputs={"out": "loop"})
    with pytest.raises(csp.GraphError, match=r"channel 'loop' is a self-loop"):
        alone.validate()


def test_cycle_without_a_source_is_rejected_naming_its_channels():
    """Invariant: processes that only feed each other, with no source (a process without inputs)
    upstream, are rejected at validation, naming the cycle's channels and processes (the run
    would wait forever for a first item); the same cycle fed by a source, or started by a process
    class that declares sends_first, validates."""
    g = csp.Graph()
    for c in ("ab", "bc", "ca", "side"):
        g.channel(c, capacity=1)
    g.process("a", Relay, inputs={"inp": "ca"}, outputs={"out": "ab"})
    g.process("b", Relay, inputs={"inp": "ab"}, outputs={"out": "bc"})
    g.process("c", Relay, inputs={"inp": "bc"}, outputs={"out": "ca"})
    g.process("side_emit", Emit, outputs={"out": "side"})      # a source elsewhere does not help
    g.process("side_take", Take, inputs={"inp": "side"})
    with pytest.raises(csp.GraphError) as e:
        g.validate()
    msg = str(e.value)
    assert "no source feeds" in msg and "would hang" in msg and "\n" not in msg
    assert all(f"'{c}'" in msg for c in ("ab", "bc", "ca")) and "'side'" not in msg
    assert all(f"'{p}'" in msg for p in ("a", "b", "c"))
    fed = csp.Graph()
    for c in ("ab", "bc", "ca", "src"):
        fed.channel(c, capacity=1)
    fed.process("emit", Emit, outputs={"out": "src"})
    fed.process("a", Join, inputs={"a": "src", "b": "ca"}, outputs={"out": "ab"})
    fed.process("b", Relay, inputs={"inp": "ab"}, outputs={"out": "bc"})
    fed.process("c", Relay, inputs={"inp": "bc"}, outputs={"out": "ca"})
    fed.validate()
    # a process that declares it sends before it receives starts the cycle itself (a handshake)
    class Starter(Relay):
        sends_first = True

    shake = csp.Graph().channel("items", capacity=1).channel("acks", capacity=1)
    shake.process("producer", Starter, inputs={"inp": "acks"}, outputs={"out": "items"})
    shake.process("consumer", Relay, inputs={"inp": "items"}, outputs={"out": "acks"})
    shake.validate()
    # downstream of an unfed cycle: the error still names the cycle, not the bystander
    tail = csp.Graph()
    for c in ("ab", "ba", "x"):
        tail.channel(c, capacity=1)
    tail.process("z", Take, inputs={"inp": "x"})
    tail.process("a", Relay, inputs={"inp": "ba"}, outputs={"out": "ab"})
    tail.process("b", Join, inputs={"a": "ab", "b": "ab"}, outputs={"out": "ba"})
    tail.process("fan", Relay, inputs={"inp": "ab"}, outputs={"out": "x"})
    with pytest.raises(csp.GraphError, match=r"channels 'ab', 'ba' form a cycle|channels 'ba', 'ab' form a cycle"):
        tail.validate()


def test_ordered_channel_with_two_producers_is_rejected(tmp_path, reg):
    """Invariant: an ordered channel restores one seq stream, so two producing processes (or two
    ports) on it are a validation error naming the channel and every producer, where before the
    run failed at the second seq 0; replicas of one process may share it."""
    g = csp.Graph().channel("items", capacity=2, ordered=True)
    g.process("emit1", Emit, outputs={"out": "items"}).process("emit2", Emit, outputs={"out": "items"})
    g.process("take", Take, inputs={"inp": "items"})
    with pytest.raises(csp.GraphError, match=r"channel 'items' is ordered but has 2 producers "
                                             r"\(process 'emit1' port 'out', process 'emit2' port 'out'\)"):
        g.validate()
    ok = csp.Graph().channel("lines", capacity=2).channel("items", capacity=2, ordered=True)
    ok.process("emit", Emit, outputs={"out": "lines"})
    ok.process("relay", Relay, replicas=3, inputs={"inp": "lines"}, outputs={"out": "items"})
    ok.process("take", Take, inputs={"inp": "items"})
    ok.validate()
    text = GOOD.replace("capacity = 4", "capacity = 4\nordered = true") + textwrap.dedent("""
        [[process]]
        name = "emit2"
        kind = "t.emit"
        outputs = { out = "items" }
        """)
    with pytest.raises(csp.GraphError, match="channel 'items' is ordered but has 2 producers"):
        csp.Graph.from_spec(csp.load_spec(write(tmp_path, text)), reg)


class Renumber(csp.Process):
    """Merges two inputs and numbers what it sends itself (one stream across its replicas)."""

    inputs = {"a": object, "b": object}
    outputs = {"out": object}
    seq_origin = True

    def run(self, inputs, outputs):  # pragma: no cover
        pass


def test_ordered_channel_with_two_seq_origins_upstream_is_rejected():
    """Invariant: an ordered channel accepts each seq once, so every item reaching it must be
    numbered by one counter; two sources upstream of it (both feeding an unordered channel the
    forwarding replicas read), or one source with two replicas, are rejected at validation naming
    the ordered channel, the origins and the processes between, where before the run failed with
    a SeqError after the data loaded."""
    g = csp.Graph().channel("lines", capacity=2).channel("items", capacity=2, ordered=True)
    g.process("emit1", Emit, outputs={"out": "lines"}).process("emit2", Emit, outputs={"out": "lines"})
    g.process("relay", Relay, replicas=2, inputs={"inp": "lines"}, outputs={"out": "items"})
    g.process("take", Take, inputs={"inp": "items"})
    with pytest.raises(csp.GraphError, match=r"ordered channel 'items' gets its seq numbers from 2 origins "
                                             r"\('emit1' and 'emit2', reaching it through 'relay'\)"):
        g.validate()
    rep = csp.Graph().channel("lines", capacity=2).channel("items", capacity=2, ordered=True)
    rep.process("emit", Emit, replicas=2, outputs={"out": "lines"})
    rep.process("relay", Relay, inputs={"inp": "lines"}, outputs={"out": "items"})
    rep.process("take", Take, inputs={"inp": "items"})
    with pytest.raises(csp.GraphError, match=r"from 2 origins \('emit' \(2 replicas\), reaching it through 'relay'\)"):
        rep.validate()
    # a process that renumbers is the one origin: what is upstream of it does not matter
    ok = csp.Graph().channel("x", capacity=2).channel("y", capacity=2).channel("items", capacity=2, ordered=True)
    ok.process("emit1", Emit, outputs={"out": "x"}).process("emit2", Emit, replicas=3, outputs={"out": "y"})
    ok.process("renumber", Renumber, replicas=2, inputs={"a": "x", "b": "y"}, outputs={"out": "items"})
    ok.process("take", Take, inputs={"inp": "items"})
    ok.validate()


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[3] / "examples").glob("*.toml")),
                         ids=lambda p: p.name)
def test_every_example_has_one_seq_origin_per_ordered_channel(path):
    """Invariant: the shipped graphs pass the seq-origin rule (dflash's target replicas fan into
    the ordered 'hidden' with the batch seqs of its one prefetch). Checked on the wiring alone, so
    GPU devices and dflash kinds need no machine to resolve them."""
    import tomllib

    from csp.graph.nodes import ChannelNode, ProcessNode
    from csp.graph.validation import check_seq_origins, seq_origins

    raw = tomllib.loads(path.read_text())
    chans = {c["name"]: ChannelNode(name=c["name"], capacity=c["capacity"], ordered=c.get("ordered", False))
             for c in raw.get("channel", [])}
    procs = {p["name"]: ProcessNode(name=p["name"], cls=csp.Process, options=None,
                                    replicas=p.get("replicas", 1), inputs=p.get("inputs", {}),
                                    outputs=p.get("outputs", {})) for p in raw.get("process", [])}
    senders = {c: [(p, port) for p in procs.values() for port, ch in p.outputs.items() if ch == c] for c in chans}
    check_seq_origins(procs, chans, senders)
    for name, c in chans.items():
        if c.ordered:
            assert len(seq_origins(procs, senders, name)[0]) == 1


def test_text_pipeline_with_a_second_source_is_rejected(tmp_path):
    """Invariant: the text pipeline validates as shipped, and a second source into its 'lines'
    (upstream of the ordered 'tokens') is a GraphError naming both sources and 'tokens'."""
    import examples.textpipe  # noqa: F401  (registers the textpipe.* kinds)

    root = Path(__file__).resolve().parents[3] / "examples"
    text = (root / "text_pipeline.toml").read_text().replace('plugins = ["examples.textpipe"]', "")
    csp.Graph.from_spec(csp.load_spec(write(tmp_path, text)))
    text += textwrap.dedent("""
        [[process]]
        name = "read2"
        kind = "textpipe.lines"
        outputs = { line = "lines" }
        """)
    with pytest.raises(csp.GraphError, match=r"ordered channel 'tokens' gets its seq numbers from 2 origins "
                                             r"\('read' and 'read2', reaching it through 'tokenize'\)"):
        csp.Graph.from_spec(csp.load_spec(write(tmp_path, text)))
