from __future__ import annotations

import pytest

from spikewatch.trainer.config import CONFIG_DIR, ConfigError, load_config, variant_names

PRESETS = sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))


def test_presets_and_variant_overlays_exist() -> None:
    for name in ("tiny_cpu", "demo", "ablation"):
        assert name in PRESETS
    assert {"baseline", "qk_norm", "z_loss", "muonclip", "qk_clip", "softcap"} <= set(
        variant_names()
    )


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads(name: str) -> None:
    cfg = load_config(CONFIG_DIR / f"{name}.toml")
    assert cfg.train.max_steps > cfg.schedule.warmup_steps


def _diff(a: dict, b: dict, prefix: str = "") -> set[str]:
    keys = set(a) | set(b)
    out: set[str] = set()
    for k in keys:
        if isinstance(a.get(k), dict) and isinstance(b.get(k), dict):
            out |= _diff(a[k], b[k], f"{prefix}{k}.")
        elif a.get(k) != b.get(k):
            out.add(f"{prefix}{k}")
    return out


@pytest.mark.parametrize(
    ("variant", "changed"),
    [
        ("baseline", set()),
        ("qk_norm", {"model.qk_norm"}),
        ("z_loss", {"model.z_loss"}),
        ("muonclip", {"optim.name", "optim.qk_clip_tau"}),
        ("qk_clip", {"optim.qk_clip_tau"}),
        ("softcap", {"model.attn_softcap", "model.final_softcap"}),
    ],
)
def test_each_variant_overlay_changes_only_its_switch(variant: str, changed: set[str]) -> None:
    base = load_config("ablation").to_dict()
    over = load_config("ablation", variants=[variant]).to_dict()
    assert _diff(base, over) == changed


def test_variants_compose_and_set_wins_over_them() -> None:
    cfg = load_config("tiny_cpu", ["model.z_loss=1e-3"], variants=["qk_norm", "z_loss"])
    assert cfg.model.qk_norm is True
    assert cfg.model.z_loss == pytest.approx(1e-3)


def test_unknown_variant_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown variant 'qknorm'; known: baseline"):
        load_config("tiny_cpu", variants=["qknorm"])


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


def test_an_unknown_watch_setting_names_the_keys_allowed() -> None:
    """As the CLI's config does: the dotted key, and what its section allows (it was pydantic's
    'Extra inputs are not permitted' alone)."""
    from spikewatch.trainer.config.sections import ConfigError
    from spikewatch.trainer.config.settings import WatchSettings

    with pytest.raises(ConfigError) as e:
        WatchSettings.build({"guard": {"rollbak": True}})
    text = str(e.value)
    assert text.startswith("invalid Watch settings:")
    assert "unknown key 'guard.rollbak'; allowed:" in text and "rollback" in text
    assert "Extra inputs" not in text
    with pytest.raises(ConfigError, match="unknown key 'probs'; allowed: .*probes"):
        WatchSettings.build({"probs": {}})
