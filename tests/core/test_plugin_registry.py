"""The one plug-in registry (rollfleet.registry) and the config checks built on it: the duplicate
rule, the unknown-name error, lazy entries, the decorator form, third-party engines chosen by
``rollout.name``, and ``trainer:`` / ``routing.policy`` typos failing when the config loads."""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from rollfleet.config import RollfleetConfig, load_config
from rollfleet.engines import ENGINES, get_engine_cls, register_engine
from rollfleet.engines.sim import SimEngine
from rollfleet.errors import AlreadyRegistered, InvalidPlugin, RollfleetError, UnknownName
from rollfleet.registry import Registry, resolve

pytestmark = pytest.mark.unit


class Base:
    pass


class Widget(Base):
    pass


class Gadget(Base):
    pass


WIDGET = f"{__name__}:Widget"


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    """A module on sys.path that nothing has imported yet; yields its name."""
    name = "rf_lazy_plugin_for_registry_test"
    (tmp_path / f"{name}.py").write_text(
        "class Thing:\n    class Inner:\n        pass\n\nAlias = Thing  # a re-export\nNOT_A_CLASS = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    yield name
    sys.modules.pop(name, None)


# ---------------------------------------------------------------------- the duplicate rule
def test_same_name_twice_raises_unless_identical_target():
    reg: Registry[type] = Registry("widget", kind=Base)
    reg.register("w", WIDGET)
    reg.register("w", WIDGET)  # the same path again
    reg.register("w", Widget)  # the object that path names
    assert reg.entry("w").loaded and reg.get("w") is Widget
    reg.register("w", WIDGET)  # a path after the object: still the same target
    with pytest.raises(AlreadyRegistered) as err:
        reg.register("w", Gadget)
    assert isinstance(err.value, ValueError) and isinstance(err.value, RollfleetError)
    assert err.value.name == "w" and "Widget" in err.value.existing and "Gadget" in err.value.new
    assert reg.get("w") is Widget  # the first registration stands
    with pytest.raises(AlreadyRegistered, match=r"with options \{\}; cannot register .* with options \{'flavour': 3\}"):
        reg.register("w", WIDGET, options={"flavour": 3})  # same class, other options: said, not two equal names


def test_a_path_that_re_exports_an_object_is_the_same_target(plugin_module):
    reg: Registry[type] = Registry("thing")
    reg.register("t", f"{plugin_module}:Alias")
    assert plugin_module not in sys.modules  # registering imports nothing
    thing = resolve(f"{plugin_module}:Thing")
    reg.register("t", thing)  # the object the path re-exports: a no-op
    assert reg.get("t") is thing
    with pytest.raises(AlreadyRegistered):
        reg.register("t", resolve(f"{plugin_module}:Thing.Inner"))


def test_a_builtin_cannot_be_replaced():
    class OtherEngine(SimEngine):
        pass

    with pytest.raises(AlreadyRegistered):
        register_engine("sim", OtherEngine)
    register_engine("sim", "rollfleet.engines.sim:SimEngine")  # the identical target: a no-op
    assert get_engine_cls("sim") is SimEngine


# ---------------------------------------------------------------------- the unknown-name error
def test_unknown_name_is_typed_and_lists_valid_names():
    reg: Registry[type] = Registry("widget", hint="or use 'pkg.module:Class'")
    reg.register("b", Gadget)
    reg.register("a", Widget)
    with pytest.raises(UnknownName) as err:
        reg.get("c")
    exc = err.value
    assert isinstance(exc, KeyError) and isinstance(exc, ValueError) and isinstance(exc, RollfleetError)
    assert (exc.family, exc.name, exc.valid) == ("widget", "c", ("a", "b"))
    assert str(exc) == "unknown widget 'c'; valid names: ['a', 'b'] (or use 'pkg.module:Class')"
    again = pickle.loads(pickle.dumps(exc))  # crosses a Ray actor boundary intact
    assert type(again) is UnknownName and again.valid == ("a", "b") and str(again) == str(exc)
    with pytest.raises(UnknownName):
        reg.get(["unhashable"])  # type: ignore[arg-type]


def _families():
    from rollfleet.agent_loop.registry import get_agent_loop
    from rollfleet.models import get_model_path
    from rollfleet.reward import get_reward_fn
    from rollfleet.routing import get_policy
    from rollfleet.tool_parser import get_tool_parser
    from rollfleet.trainer import get_trainer_cls
    from rollfleet.trainer.algos import get_advantage_estimator

    return [
        (get_engine_cls, "sim"),
        (get_policy, "least_tokens"),
        (get_trainer_cls, "separate_async"),
        (get_agent_loop, "tool_agent"),
        (get_tool_parser, "hermes"),
        (get_reward_fn, "numeric_match"),
        (get_advantage_estimator, "rloo"),
        (get_model_path, "tiny"),
    ]


def test_every_family_raises_the_same_error():
    for lookup, builtin in _families():
        with pytest.raises(UnknownName) as err:
            lookup("no-such-plugin-xyz")
        assert builtin in err.value.valid, lookup


# ---------------------------------------------------------------------- lazy entries
def test_lazy_entries_are_imported_on_first_use_only(plugin_module):
    reg: Registry[type] = Registry("thing", kind=f"{plugin_module}:Thing")  # even the kind is lazy
    reg.register("thing", f"{plugin_module}:Thing")
    reg.register("inner", f"{plugin_module}.Thing")  # verl's dotted spelling
    assert "thing" in reg and reg.names() == ["inner", "thing"] and reg.check_name("thing") == "thing"
    assert not reg.entry("thing").loaded
    assert plugin_module not in sys.modules
    cls = reg.get("thing")
    assert plugin_module in sys.modules and cls.__name__ == "Thing" and reg.entry("thing").loaded
    assert reg.get("inner") is cls


def test_a_lazy_entry_of_the_wrong_kind_fails_when_used(plugin_module):
    reg: Registry[type] = Registry("widget", kind=Base)
    reg.register("bad", f"{plugin_module}:NOT_A_CLASS")  # accepted: nothing imported yet
    with pytest.raises(InvalidPlugin) as err:
        reg.get("bad")
    assert isinstance(err.value, TypeError) and "a subclass of Base" in str(err.value)
    reg.register("typo", "no_such_module_xyz:Thing")
    with pytest.raises(ModuleNotFoundError):
        reg.get("typo")


def test_loading_a_config_imports_no_implementation():
    code = textwrap.dedent(
        """
        import sys
        from rollfleet.config import load_config
        cfg = load_config(overrides={"rollout.name": "sglang", "rollout.routing.policy": "power_of_two"})
        assert cfg.rollout.name == "sglang"
        loaded = [m for m in ("rollfleet.engines.sglang", "rollfleet.engines.sim",
                              "rollfleet.routing.policies.power_of_two", "rollfleet.trainer", "torch")
                  if m in sys.modules]
        print(loaded)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_resolve_is_the_one_import_path_resolver(plugin_module):
    assert resolve("rollfleet.engines.sim:SimEngine") is SimEngine
    assert resolve("rollfleet.engines.sim.SimEngine") is SimEngine
    assert resolve(f"{plugin_module}:Thing.Inner").__qualname__ == "Thing.Inner"
    with pytest.raises(ImportError, match="Missing"):
        resolve("rollfleet.engines.sim:Missing")
    with pytest.raises(ValueError):
        resolve("no_colon_no_dot")
    from rollfleet.agent_loop.registry import import_object

    assert import_object is resolve


# ---------------------------------------------------------------------- the decorator form
def test_register_as_a_decorator():
    reg: Registry[type] = Registry("widget", kind=Base)

    @reg.register("deco", options={"flavour": 3})
    class Decorated(Base):
        pass

    assert Decorated.__name__ == "Decorated"  # the decorator returns the class unchanged
    assert reg.get("deco") is Decorated and reg.options("deco") == {"flavour": 3}
    with pytest.raises(InvalidPlugin):
        reg.register("not_a_widget")(object)
    assert "not_a_widget" not in reg

    fns: Registry = Registry("reward", callable_only=True)
    fns.register("f")(len)
    with pytest.raises(InvalidPlugin, match="callable"):
        fns.register("g", 3)


# ---------------------------------------------------------------------- config: rollout.name
class ThirdPartyEngine(SimEngine):
    """Stands for an engine a user package adds at run time."""


def test_an_engine_registered_at_runtime_can_be_chosen_by_rollout_name():
    data = {"rollout": {"name": "thirdparty_test", "engine_args": {"tp_size": 2, "endpoint": "x"}}}
    with pytest.raises(ValidationError, match="thirdparty_test"):
        RollfleetConfig.model_validate(data)  # not registered yet
    register_engine("thirdparty_test", ThirdPartyEngine)
    try:
        cfg = RollfleetConfig.model_validate(data)
        assert cfg.rollout.name == "thirdparty_test"
        assert cfg.rollout.engine_args == {"tp_size": 2, "endpoint": "x"}
        assert cfg.rollout.tensor_parallel_size == 2
        assert get_engine_cls(cfg.rollout.name) is ThirdPartyEngine
    finally:
        ENGINES.unregister("thirdparty_test")


def test_unknown_engine_and_misplaced_engine_args_fail_at_construction(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  name: vlm\n")
    with pytest.raises(ValidationError) as err:
        load_config(path)
    error = err.value.errors()[0]
    assert error["loc"] == ("rollout", "name")
    assert set(error["ctx"]["error"].valid) >= {"sim", "vllm", "sglang"}
    with pytest.raises(ValidationError, match=r"rollout\.vllm"):
        RollfleetConfig.model_validate({"rollout": {"name": "vllm", "engine_args": {"dtype": "auto"}}})


# ---------------------------------------------------------------------- config: routing.policy
def test_a_typo_in_routing_policy_fails_naming_the_valid_ones(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  routing:\n    policy: least_token\n")
    with pytest.raises(ValidationError) as err:
        load_config(path)
    error = err.value.errors()[0]
    assert error["loc"] == ("rollout", "routing", "policy")
    assert isinstance(error["ctx"]["error"], UnknownName)
    for name in ("least_inflight", "least_tokens", "power_of_two", "rendezvous"):
        assert name in str(err.value)
    assert load_config(path, {"rollout.routing.policy": "power_of_two"}).rollout.routing.policy == "power_of_two"


# ---------------------------------------------------------------------- config: trainer
def test_a_typo_in_trainer_fails_load_config_naming_the_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  trainer_mode: sync\n  total_step: 3\n")
    with pytest.raises(ValidationError) as err:
        load_config(path)
    assert [e["loc"] for e in err.value.errors()] == [("trainer", "total_step")]
    assert "trainer.total_step" in str(err.value)
    with pytest.raises(ValidationError) as err:
        load_config(None, {"trainer.learner.lr": "fast"})  # nested sections too
    assert err.value.errors()[0]["loc"] == ("trainer", "learner", "lr")
    with pytest.raises(ValidationError, match="separate_async"):
        load_config(None, {"trainer.trainer_mode": "synk"})
    cfg = load_config(None, {"trainer.total_steps": 3})
    assert cfg.trainer.total_steps == 3


def test_rollfleet_train_rejects_a_trainer_typo_before_starting_ray(tmp_path, monkeypatch, capsys):
    import ray

    import rollfleet.cli.train as train_cli
    from rollfleet.cli.main import main

    def must_not_run(*args, **kwargs):
        raise AssertionError("training or Ray started with an invalid config")

    monkeypatch.setattr(train_cli, "run_training", must_not_run)
    monkeypatch.setattr(ray, "init", must_not_run)
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  name: sim\ntrainer:\n  trainer_mode: sync\n  totl_steps: 3\n")
    assert main(["train", "--config", str(path)]) == 2
    assert "trainer.totl_steps" in capsys.readouterr().err


def test_a_config_section_rollfleet_does_not_read_is_named_on_stderr(tmp_path, capsys):
    """Unknown top-level sections are kept for tools built on top, but a typo (``rolout``) ran a
    whole simulation on the defaults without a word."""
    from rollfleet.cli.main import main

    path = tmp_path / "typo.yaml"
    path.write_text("rolout: {num_replicas: 7}\n")
    assert (
        main(
            ["simulate", "--virtual", "--sessions", "2", "--turns", "1", "--weight-updates", "0", "--config", str(path)]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert err.count("config section 'rolout' is not one rollfleet reads (rollout, ray, agent, gateway, trainer)") == 1


def test_rollfleet_train_refuses_an_output_dir_it_cannot_write_before_starting_ray(tmp_path, monkeypatch, capsys):
    """A file where the run's folder goes was a NotADirectoryError traceback once Ray had started."""
    import ray

    import rollfleet.cli.train as train_cli
    from rollfleet.cli.main import main

    def must_not_run(*args, **kwargs):
        raise AssertionError("training or Ray started with an unwritable output_dir")

    monkeypatch.setattr(train_cli, "run_training", must_not_run)
    monkeypatch.setattr(ray, "init", must_not_run)
    (tmp_path / "afile").write_text("")
    path = tmp_path / "c.yaml"
    path.write_text(f"rollout:\n  name: sim\ntrainer:\n  output_dir: {tmp_path / 'afile'}\n")
    assert main(["train", "--config", str(path)]) == 2
    assert (
        f"rollfleet train: trainer.output_dir / trainer.run_name: {tmp_path / 'afile'} is a file, not a folder"
        in capsys.readouterr().err
    )


def test_a_config_file_that_is_missing_or_not_a_yaml_mapping_is_named_and_refused(tmp_path, monkeypatch, capsys):
    """Each was a traceback from every command (FileNotFoundError, a YAML parser error, or an
    AttributeError from a list); now one line naming the file, status 2, before Ray starts."""
    import ray

    from rollfleet.cli.main import main

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started on a config that was not read"))
    missing = tmp_path / "missing.yaml"
    not_yaml = tmp_path / "broken.yaml"
    not_yaml.write_text("rollout: [\n")
    a_list = tmp_path / "list.yaml"
    a_list.write_text("- rollout\n- trainer\n")
    twice = tmp_path / "twice.yaml"  # YAML keeps the last: n: 4 was dropped without a word
    twice.write_text("rollout: {n: 4}\nrollout: {num_replicas: 7}\n")
    unhashable = tmp_path / "unhashable.yaml"
    unhashable.write_text("rollout:\n  [a, b]: 1\n")
    merged = tmp_path / "merged.yaml"  # anchors and merge keys are still YAML
    merged.write_text("base: &b\n  num_replicas: 2\nrollout:\n  <<: *b\n  n: 4\n")
    assert (load_config(merged).rollout.num_replicas, load_config(merged).rollout.n) == (2, 4)
    for path, says in (
        (missing, "No such file or directory"),
        (not_yaml, "broken.yaml is not YAML"),
        (a_list, "list.yaml: the top level must map section names to settings, got a list"),
        (twice, "the key 'rollout' is given twice in one mapping"),
        (unhashable, "found unhashable key"),
    ):
        with pytest.raises(ValueError if path != missing else OSError, match=says):
            load_config(path)
        for command in (["train"], ["simulate", "--virtual"], ["plan", "--gpus", "2"]):
            assert main([*command, "--config", str(path)]) == 2, (command, path)
            err = capsys.readouterr().err
            assert "rollfleet: cannot read config:" in err and says in err, (command, err)


def test_section_validators_skip_sections_not_given(monkeypatch):
    from rollfleet import config as config_mod

    seen = []
    monkeypatch.setattr(config_mod, "SECTION_VALIDATORS", Registry("config section validator", callable_only=True))
    config_mod.register_section_validator("my_tool", seen.append)
    config_mod.register_section_validator("gateway", lambda section: seen.append(dict(section)))
    load_config(None, {"rollout.num_replicas": 1})
    assert seen == []
    load_config(None, {"my_tool.knob": 1})
    assert seen == [{"knob": 1}]


def test_a_dotted_override_through_an_empty_section_or_a_value_is_named(tmp_path):
    """``rollout:`` alone in a file, then ``--replicas 2``, was a TypeError traceback; an override
    that goes through a value names the key and what it found."""
    empty = tmp_path / "empty_section.yaml"
    empty.write_text("rollout:\n")
    assert load_config(empty, {"rollout.num_replicas": 2}).rollout.num_replicas == 2
    with pytest.raises(ValueError, match=r"override rollout.n.x: rollout.n is a int \(4\), not a section"):
        load_config(None, {"rollout.n": 4, "rollout.n.x": 1})


def test_the_sim_engine_refuses_an_eos_outside_its_vocabulary_and_a_kv_cache_without_one_sequence():
    """An EOS id never sampled meant no response ever stopped; a KV cache of 16 tokens answered a
    40-token prompt with nothing, stop_reason 'length'. vLLM refuses to start such a replica."""
    from rollfleet.config import RolloutConfig, SimEngineConfig

    with pytest.raises(
        ValidationError, match=r"rollout.sim.eos_token_id \(100\) must be < rollout.sim.vocab_size \(16\)"
    ):
        SimEngineConfig(vocab_size=16, eos_token_id=100)
    rollout = RolloutConfig(name="sim", prompt_length=128, max_model_len=256, sim={"kv_capacity_tokens": 250})
    with pytest.raises(ValueError, match=r"kv_capacity_tokens \(250, 240 in whole blocks of 16\) holds less than one"):
        SimEngine.from_config(rollout, replica_index=0)
    SimEngine.from_config(
        RolloutConfig(name="sim", prompt_length=128, max_model_len=256, sim={"kv_capacity_tokens": 256}), 0
    )


def test_fitting_the_sim_engine_to_a_model_keeps_its_vocabulary_valid_and_refuses_a_conflicting_setting(tmp_path):
    """fit_sim_to_model copied the model's vocabulary in unvalidated (an EOS of 5000 in a
    vocabulary of 1000: no response ever stopped) and overwrote what the config set, silently."""
    import json

    from rollfleet.models.vocab import fit_sim_to_model

    def model(vocab: int, eos: int) -> str:
        folder = tmp_path / f"m{vocab}-{eos}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"vocab_size": vocab, "eos_token_id": eos}))
        return str(folder)

    fitted = fit_sim_to_model(load_config(None, {"rollout.name": "sim", "rollout.model": model(1000, 7)}))
    assert (fitted.rollout.sim.vocab_size, fitted.rollout.sim.eos_token_id) == (1000, 7)
    with pytest.raises(ValidationError, match=r"eos_token_id \(5000\) must be < rollout.sim.vocab_size \(1000\)"):
        fit_sim_to_model(load_config(None, {"rollout.name": "sim", "rollout.model": model(1000, 5000)}))
    given = {"rollout.name": "sim", "rollout.model": model(2000, 3), "rollout.sim.vocab_size": 500}
    with pytest.raises(
        ValueError, match=r"rollout.sim.vocab_size \(500\) set, but the sim engine takes model .*vocab_size 2000"
    ):
        fit_sim_to_model(load_config(None, given))
    same = fit_sim_to_model(load_config(None, {**given, "rollout.sim.vocab_size": 2000}))
    assert same.rollout.sim.vocab_size == 2000  # set to what the model says: nothing to refuse
    # a multimodal model keeps both under text_config (a KeyError, a traceback from the CLI)
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    (vlm / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 3000, "eos_token_id": 9}}))
    fitted = fit_sim_to_model(load_config(None, {"rollout.name": "sim", "rollout.model": str(vlm)}))
    assert (fitted.rollout.sim.vocab_size, fitted.rollout.sim.eos_token_id) == (3000, 9)
    empty = tmp_path / "no-config"
    empty.mkdir()
    with pytest.raises(ValueError, match="rollout.model .*cannot read"):
        fit_sim_to_model(load_config(None, {"rollout.name": "sim", "rollout.model": str(empty)}))


def test_rollfleet_train_refuses_a_sim_vocabulary_the_model_contradicts_before_starting_ray(
    tmp_path, monkeypatch, capsys
):
    import ray

    import rollfleet.cli.train as train_cli
    from rollfleet.cli.main import main

    monkeypatch.setattr(train_cli, "run_training", lambda *a, **k: pytest.fail("training started"))
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started"))
    path = tmp_path / "c.yaml"
    path.write_text(f"rollout:\n  name: sim\n  sim: {{vocab_size: 500}}\ntrainer:\n  output_dir: {tmp_path}\n")
    assert main(["train", "--config", str(path)]) == 2
    assert (
        "rollfleet train: rollout.sim.vocab_size (500) set, but the sim engine takes model" in capsys.readouterr().err
    )


def test_a_derived_max_model_len_follows_the_lengths_and_a_given_one_stays():
    """Derived once at construction, it went stale: response_length set to 10**6 afterwards left
    max_model_len at 1,024, and every response was cut there."""
    from rollfleet.config import RolloutConfig

    derived = RolloutConfig(prompt_length=24, response_length=1000)
    assert derived.max_model_len == 1024
    derived.response_length = 10**6
    assert derived.max_model_len == 10**6 + 24
    given = RolloutConfig(prompt_length=24, response_length=1000, max_model_len=3000)
    given.response_length = 2000
    assert given.max_model_len == 3000


def test_settings_a_run_would_trip_over_later_are_refused_naming_them():
    """Each was accepted: a max_model_len no longer than prompt_length (every full-length prompt
    refused mid-run, naming prompt_ids), several replicas on
    one attached SGLang server (its load counted twice, one's pause stopping the other), and a
    server flag in extra_args that rollfleet sets from a field (the last one given won: a server
    at another tensor parallelism than placement reserved, another context than the checks knew)."""
    from rollfleet.config import load_config

    cases = [
        ({"rollout.max_model_len": 100}, "rollout.max_model_len (100) must be > rollout.prompt_length (512)"),
        (
            {"rollout.name": "sim", "rollout.sim.max_model_len": 512},
            "rollout.sim.max_model_len (512) must be > rollout.prompt_length (512)",
        ),
        (
            {"rollout.name": "sglang", "rollout.sglang.base_url": "http://127.0.0.1:30000"},
            "rollout.num_replicas must be 1 with it, got 2",
        ),
        (
            {"rollout.vllm.extra_args": ["--enforce-eager", "--tensor-parallel-size", "2"]},
            "rollout.vllm.extra_args: --tensor-parallel-size is set by rollfleet from rollout.vllm.tensor_parallel_size",
        ),
        (
            {"rollout.vllm.extra_args": ["--max-model-len=4096"]},
            "rollout.vllm.extra_args: --max-model-len is set by rollfleet from rollout.max_model_len",
        ),
        (
            {"rollout.sglang.extra_args": ["--context-length", "4096"]},
            "rollout.sglang.extra_args: --context-length is set by rollfleet from rollout.max_model_len",
        ),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            load_config(None, overrides)
    attached = load_config(
        None, {"rollout.name": "sglang", "rollout.sglang.base_url": "http://127.0.0.1:30000", "rollout.num_replicas": 1}
    )
    assert attached.rollout.num_replicas == 1
    assert load_config(None, {"rollout.vllm.extra_args": ["--enable-chunked-prefill"]}).rollout.vllm.extra_args


def test_the_sim_engines_own_max_model_len_is_honoured_and_a_conflict_refused():
    """``rollout.sim.max_model_len`` alone was ignored: the engine took prompt_length +
    response_length (124 here), refusing every longer prompt the user had sized it for."""
    from rollfleet.config import RolloutConfig
    from rollfleet.engines.sim import SimEngine

    own = RolloutConfig(name="sim", prompt_length=24, response_length=100, sim={"max_model_len": 4096})
    assert SimEngine.from_config(own, 0).limits().max_model_len == 4096
    assert own.max_model_len == 4096
    again = RolloutConfig.model_validate(own.model_dump())  # dumped and loaded (a plan does so)
    assert (again.max_model_len, again.sim.max_model_len) == (4096, 4096)
    derived = RolloutConfig.model_validate(RolloutConfig(name="sim", prompt_length=24).model_dump())
    assert derived.max_model_len == derived.sim.max_model_len == 24 + 512
    with pytest.raises(
        ValueError, match=r"rollout.sim.max_model_len \(4096\) differs from rollout.max_model_len \(300\)"
    ):
        RolloutConfig(name="sim", max_model_len=300, sim={"max_model_len": 4096})


def test_a_dumped_config_of_another_engine_validates_again_as_the_sim():
    """A plan dumps the config and renames its engine to sim: from a vllm config (demo.yaml) that
    met the sim section's default context (32,768) as if given, against the derived one."""
    from pathlib import Path

    from rollfleet.config import RolloutConfig, load_config
    from rollfleet.plan.spec import PlanSpec

    demo = load_config(Path(__file__).parents[2] / "configs" / "demo.yaml")
    assert demo.rollout.name == "vllm"
    planned = PlanSpec(demo, gpus=4, modes=("sync",), seeds=(0,)).config_for("sync", 0)
    assert planned.rollout.name == "sim" and planned.rollout.sim.max_model_len == demo.rollout.max_model_len
    renamed = RolloutConfig.model_validate(RolloutConfig(name="vllm").model_dump())
    renamed.name = "sim"
    assert renamed.max_model_len == renamed.sim.max_model_len == 1024
    tiny = RolloutConfig.model_validate(RolloutConfig(name="sim", prompt_length=4, response_length=8).model_dump())
    assert tiny.max_model_len == tiny.sim.max_model_len == 12  # the sim section takes any context a rollout does


def test_an_assignment_a_validator_refuses_leaves_the_section_as_it_was():
    """pydantic applies an assigned value before the section's own validators, and kept it when
    one refused it: the section was left in the state the error had just refused."""
    from pydantic import ValidationError

    from rollfleet.config import RolloutConfig

    own = RolloutConfig(name="sim", sim={"max_model_len": 4096})
    with pytest.raises(ValidationError, match="differs from rollout.max_model_len"):
        own.max_model_len = 300
    assert (own.max_model_len, "max_model_len" in own.model_fields_set) == (4096, False)
    other = RolloutConfig(name="vllm", max_model_len=600, sim={"max_model_len": 4096})
    with pytest.raises(ValidationError):
        other.name = "sim"
    assert (other.name, other.max_model_len) == ("vllm", 600)
    other.prompt_length = 100  # a good assignment still lands
    assert other.prompt_length == 100


def test_a_run_refuses_before_ray_starts_what_it_would_find_wrong_once_running(tmp_path, monkeypatch, capsys):
    """Each of these ran Ray and the fleet up first: a typo in the agent loop, the http_agent with
    nothing to run or the task was a traceback 14-16 s later, a KV cache that holds no sequence one
    once the replicas started; a max_model_len no longer than prompt_length trained on empty
    responses without a word, and an empty section was refused only when no flag touched it."""
    import ray

    import rollfleet.cli.train as train_cli
    from rollfleet.cli.main import main

    def must_not_run(*args, **kwargs):
        raise AssertionError("training or Ray started")

    monkeypatch.setattr(train_cli, "run_training", must_not_run)
    monkeypatch.setattr(ray, "init", must_not_run)
    cases = [
        ("agent: {default_agent_loop: singel_turn_agent}", "agent.default_agent_loop: unknown agent loop"),
        ("agent: {default_agent_loop: http_agent}", "agent.http_agent: give agent (a callable) or command"),
        ("agent: {default_agent_loop: http_agent, http_agent: {agent: 'a:b', command: [x]}}", "one of them"),
        ("agent: {default_agent_loop: tool_agent, multi_turn: {format: hermess}}", "agent.multi_turn.format: unknown"),
        ("trainer: {task: cnt}", "trainer.task: unknown task 'cnt'"),
        ("rollout: {name: sim, prompt_length: 64, max_model_len: 64}\ntrainer: {task: synthetic}", "must be > rollout.prompt_length (64)"),
        ("rollout: {name: sim, sim: {kv_capacity_tokens: 512}}", "holds less than one sequence"),
        # an empty fleet waited 300 s a request, then failed; a mistyped agent failed every sample
        ("rollout: {name: sim, num_replicas: 0}", "rollout.num_replicas must be >= 1 to train, got 0"),
        ("agent: {default_agent_loop: http_agent, http_agent: {agent: 'examples/openai_sdk_agnt.py:solve'}}", "agent.http_agent.agent: no file examples/openai_sdk_agnt.py"),
        ("agent: {default_agent_loop: http_agent, http_agent: {agent: 'no_such_pkg.agents:solve'}}", "no package 'no_such_pkg' to import 'no_such_pkg.agents' from"),
        ("agent: {default_agent_loop: http_agent, http_agent: {command: [no-such-agent-program]}}", "agent.http_agent.command: no program 'no-such-agent-program'"),
        ("gateway: {prometheus_port: 9090}", "gateway.prometheus_port requires gateway.prometheus_file"),
    ]  # fmt: skip
    for text, message in cases:
        path = tmp_path / "c.yaml"
        path.write_text(text + "\n")
        assert main(["train", "--config", str(path), "--steps", "1"]) == 2, text
        assert message in capsys.readouterr().err, text
    path.write_text("rollout: {name: sim, num_replicas: 1, sim: {kv_capacity_tokens: 512}}\n")
    assert main(["simulate", "--virtual", "--config", str(path)]) == 2  # a traceback once it ran
    assert "holds less than one sequence" in capsys.readouterr().err
    shipped = "ray: {address: auto, runtime_env: {working_dir: /somewhere/agents}}"  # the workers' files, not ours
    for fine, more in (
        ("examples/openai_sdk_agent.py:solve", ""),
        ("rollfleet.agent_loop.testing:ScriptedTurns", ""),
        ("my_agent.py:solve", shipped),  # in the working_dir the workers get: not looked for here
    ):
        path.write_text(f"agent: {{default_agent_loop: http_agent, http_agent: {{agent: '{fine}'}}}}\n{more}\n")
        monkeypatch.chdir(Path(__file__).resolve().parents[2])
        with pytest.raises(AssertionError, match="training or Ray started"):
            main(["train", "--config", str(path), "--steps", "1"])
    path.write_text("rollout: {name: sim}\ngateway:\n  # port: 9001\n")
    from rollfleet.config import load_config

    assert load_config(str(path)).gateway.port == load_config(str(path), {"gateway.port": 8000}).gateway.port


def test_serve_refuses_an_unknown_tool_call_parser_and_an_empty_admin_token_env_is_not_one(
    tmp_path, monkeypatch, capsys
):
    import rollfleet.gateway.launch as launch
    from rollfleet.cli.main import main

    async def must_not_run(*args, **kwargs):
        raise AssertionError("the fleet started")

    monkeypatch.setattr(launch, "serve", must_not_run)
    path = tmp_path / "c.yaml"
    path.write_text("rollout: {name: sim}\ngateway: {tool_call_parser: hermez, admin_token: s3cret}\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert "gateway.tool_call_parser: unknown" in capsys.readouterr().err
    path.write_text("rollout: {name: sim}\ngateway: {admin_token: s3cret}\n")
    monkeypatch.setenv("ROLLFLEET_ADMIN_TOKEN", "")  # set but empty: the config's token stands
    seen = {}

    async def record(config, announce=None):
        seen["token"] = config.gateway.admin_token
        return 0

    monkeypatch.setattr(launch, "serve", record)
    assert main(["serve", "--config", str(path)]) == 0
    assert seen["token"] == "s3cret"
    # a token read from a file keeps its newline: the admin routes were on, and refused every caller
    monkeypatch.setenv("ROLLFLEET_ADMIN_TOKEN", "s3cret\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert "gateway.admin_token must not be blank or begin or end with whitespace" in capsys.readouterr().err
