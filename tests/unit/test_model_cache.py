"""The model cache (libra/model_cache.py) and the warm-started tiny model's recipe (model_state.py):
built once per recipe, copied into each run, safe when two runs build the same entry at once."""

from __future__ import annotations

import pathlib

import pytest

from libra import model_cache
from libra.config import build_run_config


def _build_counting(calls: list[pathlib.Path], text: str = "weights"):
    def build(directory: pathlib.Path) -> None:
        calls.append(directory)
        directory.mkdir(parents=True)
        (directory / "config.json").write_text("{}")
        (directory / "model.safetensors").write_text(text)
    return build


def test_the_cache_root_comes_from_the_environment(tmp_path):
    assert model_cache.cache_root({}) == pathlib.Path.home() / ".cache" / "libra"
    assert model_cache.cache_root({"LIBRA_CACHE": str(tmp_path)}) == tmp_path
    for off in ("off", "OFF", "0", "none"):
        assert model_cache.cache_root({"LIBRA_CACHE": off}) is None
    with pytest.raises(ValueError, match="LIBRA_CACHE='relative/dir' must be an absolute path"):
        model_cache.cache_root({"LIBRA_CACHE": "relative/dir"})


def test_an_entry_is_built_once_and_copied_into_each_run(tmp_path):
    calls: list[pathlib.Path] = []
    recipe = {"model": {"hidden_size": 128}, "seed": 0}
    first, second = tmp_path / "run1" / "base", tmp_path / "run2" / "base"
    assert model_cache.cached_model(tmp_path / "cache", recipe, first, _build_counting(calls)) is False
    assert model_cache.cached_model(tmp_path / "cache", recipe, second, _build_counting(calls)) is True
    assert len(calls) == 1 and calls[0].parent == tmp_path / "cache" / "models"  # built in the cache, not the run
    for dest in (first, second):
        assert sorted(p.name for p in dest.iterdir()) == ["config.json", "model.safetensors"]  # no cache file
    (second / "model.safetensors").write_text("trained further")  # a run's copy is its own
    entry = tmp_path / "cache" / "models" / model_cache.model_key(recipe)
    assert (entry / "model.safetensors").read_text() == "weights"
    assert sorted(p.name for p in (tmp_path / "cache" / "models").iterdir()) == [entry.name]  # no partials left
    other = {"model": {"hidden_size": 64}, "seed": 0}
    assert model_cache.cached_model(tmp_path / "cache", other, tmp_path / "run3", _build_counting(calls)) is False
    assert len(calls) == 2


def test_two_runs_building_the_same_entry_at_once_both_get_it(tmp_path):
    cache, recipe, calls = tmp_path / "cache", {"seed": 1}, []

    def slow_build(directory: pathlib.Path) -> None:  # another run stores the entry while this one builds
        _build_counting(calls, "mine")(directory)
        assert model_cache.cached_model(cache, recipe, tmp_path / "other", _build_counting(calls, "theirs")) is False

    assert model_cache.cached_model(cache, recipe, tmp_path / "mine", slow_build) is False
    assert len(calls) == 2
    assert (tmp_path / "mine" / "model.safetensors").read_text() == "theirs"  # the entry that won the rename
    assert [p.name for p in (cache / "models").iterdir()] == [model_cache.model_key(recipe)]


def test_a_failed_build_stores_nothing_and_no_cache_builds_in_place(tmp_path):
    def broken(directory: pathlib.Path) -> None:
        directory.mkdir(parents=True)
        raise InterruptedError("stopped")

    with pytest.raises(InterruptedError):
        model_cache.cached_model(tmp_path / "cache", {"seed": 2}, tmp_path / "run", broken)
    assert list((tmp_path / "cache" / "models").iterdir()) == [] and not (tmp_path / "run").exists()
    calls: list[pathlib.Path] = []
    assert model_cache.cached_model(None, {"seed": 2}, tmp_path / "run", _build_counting(calls)) is False
    assert calls == [tmp_path / "run"]


def _config(**trainer):
    return build_run_config({"workload": {"name": "calculator", "num_prompts": 50},
                             "trainer": {"warmup": {"steps": 3, "batch_size": 4}, **trainer}}, env={})


def test_the_recipe_changes_with_what_shapes_the_model_only():
    from libra.services.trainer.model_state import warm_model_recipe
    from libra.workloads.base import build_workload

    def key(config):
        return model_cache.model_key(warm_model_recipe(config, build_workload(config.workload)))

    base = _config()
    assert key(base) == key(_config())
    assert key(base) == key(base.model_copy(update={"workload": base.workload.model_copy(update={"num_prompts": 60})}))
    assert key(base) != key(_config(warmup={"steps": 4, "batch_size": 4}))
    assert key(base) != key(base.model_copy(update={"seed": 1}))
    assert key(base) != key(base.model_copy(update={"model": base.model.model_copy(update={"hidden_size": 64})}))
    changed = base.workload.model_copy(update={"direct_answer_fraction": 0.9})  # other demonstrations
    assert key(base) != key(base.model_copy(update={"workload": changed}))


def test_a_synthetic_workload_is_keyed_by_its_code_and_config_a_data_workload_by_its_texts(monkeypatch):
    """The calculator's texts are its code on its config: the key is made without making them (they
    cost ~0.7 CPU-s at every start); a workload that reads data is keyed by its generated texts."""
    from libra.services.trainer.model_state import warm_model_recipe
    from libra.workloads.base import build_workload
    from libra.workloads.calculator import CalculatorWorkload

    config = _config()
    workload = build_workload(config.workload)

    def made(*_args):
        raise AssertionError("the texts were generated for a synthetic workload's key")

    monkeypatch.setattr(workload, "demonstrations", made)
    recipe = warm_model_recipe(config, workload)
    assert recipe["texts_from"]["config"]["direct_answer_fraction"] == config.workload.direct_answer_fraction
    assert "num_prompts" not in recipe["texts_from"]["config"] and "demonstrations" not in recipe

    class ReadsData(CalculatorWorkload):  # the default: no claim about where its texts come from
        def warm_start_inputs(self):
            return None

    data = ReadsData(config.workload)
    keyed = warm_model_recipe(config, data)
    assert "texts_from" not in keyed and keyed["demonstrations"] and keyed["corpus"]
    fewer = ReadsData(config.workload.model_copy(update={"max_operand": 9}))  # other texts, other key
    assert warm_model_recipe(config, fewer)["demonstrations"] != keyed["demonstrations"]


def test_the_warm_started_model_is_reused_from_the_cache(tmp_path, monkeypatch):
    from libra.services.trainer.model_state import base_model

    monkeypatch.setenv("LIBRA_CACHE", str(tmp_path / "cache"))
    config = _config()
    assert base_model(config, tmp_path / "a") is False
    assert base_model(config, tmp_path / "b") is True
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert (tmp_path / "b" / "tokenizer.json").is_file() and (tmp_path / "b" / "config.json").is_file()
