from __future__ import annotations

import pytest

from trainer.config import CONFIG_DIR, ConfigError, load_config

PRESETS = sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))


def test_presets_exist_for_every_variant() -> None:
    for name in ["tiny_cpu", "demo"] + [
        f"ablation_{v}" for v in ("baseline", "qk_norm", "z_loss", "muonclip", "softcap")
    ]:
        assert name in PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads(name: str) -> None:
    cfg = load_config(CONFIG_DIR / f"{name}.toml")
    assert cfg.train.max_steps > cfg.schedule.warmup_steps


def test_variants_differ_from_baseline_only_in_their_switch() -> None:
    base = load_config("ablation_baseline").to_dict()
    assert load_config("ablation_qk_norm").model.qk_norm is True
    assert load_config("ablation_z_loss").model.z_loss == pytest.approx(1e-4)
    assert load_config("ablation_muonclip").optim.name == "muonclip"
    soft = load_config("ablation_softcap").to_dict()
    assert soft["model"]["attn_softcap"] and soft["model"]["final_softcap"]
    soft["model"].update(attn_softcap=None, final_softcap=None)
    assert {k: v for k, v in soft.items() if k != "name"} == {
        k: v for k, v in base.items() if k != "name"
    }


def test_overrides_are_typed() -> None:
    cfg = load_config("tiny_cpu", ["optim.lr=1e-3", "model.qk_norm=true", "optim.betas=[0.8, 0.9]"])
    assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.lr, float)
    assert cfg.model.qk_norm is True
    assert cfg.optim.betas == (0.8, 0.9)


def test_none_disables_an_optional_setting() -> None:
    cfg = load_config("tiny_cpu", ["optim.grad_clip=none", "eval.interval=null"])
    assert cfg.optim.grad_clip is None and cfg.eval.interval is None


def test_override_beats_file_beats_default() -> None:
    assert load_config(None).train.max_steps == 200
    assert load_config("tiny_cpu").train.max_steps == 250
    assert load_config("tiny_cpu", ["train.max_steps=30"]).train.max_steps == 30


def test_unknown_key_in_override_names_it_and_the_allowed_keys() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'optim\.lrr'.*\blr\b"):
        load_config("tiny_cpu", ["optim.lrr=1"])


def test_unknown_key_in_file_is_an_error(tmp_path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text("[model]\nqknorm = true\n")
    with pytest.raises(ConfigError, match=r"unknown key 'model\.qknorm'.*qk_norm"):
        load_config(p)


def test_unknown_section_is_an_error(tmp_path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text("[modle]\nn_layer = 2\n")
    with pytest.raises(ConfigError, match=r"unknown key 'modle'.*model"):
        load_config(p)


def test_wrong_type_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"train\.max_steps.*integer.*'abc'"):
        load_config("tiny_cpu", ["train.max_steps=abc"])


def test_negative_lr_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"optim\.lr: Input should be greater than 0"):
        load_config("tiny_cpu", ["optim.lr=-0.1"])


def test_bad_choice_lists_the_allowed_values() -> None:
    with pytest.raises(ConfigError, match=r"optim\.name.*'adamw', 'muon' or 'muonclip'"):
        load_config("tiny_cpu", ["optim.name=sgd"])


def test_cross_field_checks() -> None:
    with pytest.raises(ConfigError, match="exceeds model.max_seq_len"):
        load_config("tiny_cpu", ["data.seq_len=512"])
    with pytest.raises(ConfigError, match="divisible by n_head"):
        load_config("tiny_cpu", ["model.n_head=3"])
    with pytest.raises(ConfigError, match="multiple of micro_batch_size"):
        load_config("tiny_cpu", ["data.micro_batch_size=5"])


def test_override_syntax_errors() -> None:
    with pytest.raises(ConfigError, match="key=value"):
        load_config("tiny_cpu", ["optim.lr"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        load_config("tiny_cpu", ["optim.lr.x=1"])


def test_missing_or_broken_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")
    p = tmp_path / "broken.toml"
    p.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(p)


def test_muonclip_defaults_tau_to_100() -> None:
    assert load_config(None, ["optim.name=muonclip"]).optim.qk_clip_tau == 100.0
    assert load_config(None, ["optim.name=adamw"]).optim.qk_clip_tau is None


def test_distributed_section_refuses_what_sharding_cannot_do() -> None:
    assert load_config(None, ["distributed.strategy=none"]).distributed.strategy is None
    assert load_config(None, ["distributed.strategy=fsdp2"]).distributed.backend == "auto"
    with pytest.raises(ConfigError, match="needs whole weight matrices"):
        load_config(None, ["distributed.strategy=fsdp2", "optim.name=muon"])
    with pytest.raises(ConfigError, match="use distributed.strategy='ddp'"):
        load_config(None, ["distributed.strategy=fsdp2", "optim.qk_clip_tau=50"])
    with pytest.raises(ConfigError, match="async_save is not supported"):
        load_config(None, ["distributed.strategy=ddp", "checkpoint.async_save=true"])
    with pytest.raises(ConfigError, match="distributed.strategy"):
        load_config(None, ["distributed.strategy=zero3"])
    load_config(None, ["distributed.strategy=ddp", "optim.name=muonclip"])  # whole weights
