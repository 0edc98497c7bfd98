"""The variant registry (:mod:`dflash.model.variants`) agrees with the config tables, the model
modules and the export; the late-added key marks (:mod:`dflash.tables`) are valid values."""

from __future__ import annotations

import importlib
from pathlib import Path

import msgspec
import pytest

from dflash.model.drafter_config import DrafterConfig
from dflash.model.variants import VARIANT_NAMES, VARIANTS, by_architecture, variant_of
from dflash.run.config import DFlashFile, added_later_keys, tables
from dflash.tables import keys_added_later
from dflash.train.loss import LossConfig

MODEL_DIR = Path(__file__).resolve().parents[3] / "dflash" / "model"


def test_each_variant_owns_fields_of_the_tables_and_no_two_share_one():
    drafter, loss = set(DrafterConfig.__struct_fields__), set(LossConfig.__struct_fields__)
    seen: dict[str, str] = {}
    for v in VARIANTS:
        assert set(v.drafter_fields) <= drafter, v.name
        assert set(v.loss_fields) <= loss, v.name
        for f in (*v.drafter_fields, *v.loss_fields):
            assert f not in seen, f"{f} is owned by {seen[f]} and {v.name}"
            seen[f] = v.name
        for f in v.drafter_fields:  # a variant's own keys are hashed by the variant rule, not when set
            mark = keys_added_later(DrafterConfig)[f]
            assert not mark.hashed_when_set and mark.before == DrafterConfig.__struct_defaults__[
                DrafterConfig.__struct_fields__.index(f)]


def test_the_variant_key_accepts_exactly_the_declared_names():
    for name in VARIANT_NAMES:
        assert msgspec.convert({"variant": name}, DrafterConfig).variant == name
    with pytest.raises(msgspec.ValidationError, match="variant"):
        msgspec.convert({"variant": "medusa2"}, DrafterConfig)
    with pytest.raises(ValueError, match="not a variant; use one of"):
        variant_of("medusa2")


def test_each_variant_module_and_export_file_exists():
    assert len({v.architecture for v in VARIANTS}) == len(VARIANTS)
    for v in VARIANTS:
        assert by_architecture(v.architecture) is v
        if v.module is not None:
            assert v.module.startswith("dflash.model."), v.module  # its own room: the drafter imports it
            mod = importlib.import_module(v.module)
            assert hasattr(mod, "drafter_parts") or hasattr(mod, "decoder_layer_parts"), v.module
        if v.remote_code is not None:
            text = (MODEL_DIR / v.remote_code).read_text()
            assert f"class {v.architecture}(" in text and "import dflash" not in text
        assert v.drafts_with in ("top1", "selector", "refiner")


def test_every_late_added_key_marks_a_value_its_field_accepts():
    found = added_later_keys()
    assert {"target", "drafter", "train", "loss", "run"} <= set(found)
    for name, table in tables(DFlashFile).items():
        for key, before in found.get(name, {}).items():
            required = {"run": {"out_dir": "x", "steps": 1}}.get(name, {})
            assert getattr(msgspec.convert({**required, key: before}, table), key) == before, f"{name}.{key}"


def test_an_unknown_variant_names_the_known_ones_and_another_variants_key_is_a_warning():
    """A misspelt variant is one line listing the declared names; a key only another variant reads,
    set away from its default, is named in a warning (it changes nothing in this run), and not when
    the run's variant reads it."""
    from dflash.errors import ConfigError
    from dflash.run.config import load_config, unread_variant_keys
    from tests.dflash.run.test_run_e2e import GRAPH

    with pytest.raises(ConfigError, match="drafter.variant is one of dflash, dflash2, xpress, resblock"):
        load_config(GRAPH, ['drafter.variant="dflash3"'])
    warned = unread_variant_keys(load_config(GRAPH, ["drafter.selector_top_k=8", "loss.xpress_base_weight=0.5"]))
    assert len(warned) == 2 and 'read by drafter.variant = "dflash2" only' in warned[0] and "xpress" in warned[1]
    assert unread_variant_keys(load_config(GRAPH, ['drafter.variant="dflash2"', "drafter.selector_top_k=8"])) == []
    assert unread_variant_keys(load_config(GRAPH)) == []
