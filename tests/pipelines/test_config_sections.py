"""The run configs are composed of sections: each option belongs to exactly one, a YAML file may
give options flat or by section, a section can be taken out typed, and no test hook is an option."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

import dpcore
from pipelines.config import (
    SECTIONS,
    DataConfig,
    PrivacyConfig,
    ScaleConfig,
    TrainConfig,
    add_config_arguments,
    config_from_dict,
    load_config,
)
from pipelines.config.options import section_of
from pipelines.federated import FederatedConfig


def test_every_option_belongs_to_exactly_one_section():
    declared: dict[str, str] = {}
    for cls in SECTIONS:
        for f in dataclasses.fields(cls):
            assert declared.setdefault(f.name, cls.SECTION) == cls.SECTION, f.name
    assert set(declared) == {f.name for f in dataclasses.fields(TrainConfig)}
    assert {c.SECTION for c in SECTIONS} == {"data", "model", "privacy", "method", "audit", "cluster", "tracking"}


def test_the_flat_order_of_options_is_data_first_and_tracking_last():
    order = [section_of(TrainConfig)[f.name] for f in dataclasses.fields(TrainConfig)]
    firsts = list(dict.fromkeys(order))
    assert firsts == ["data", "model", "privacy", "method", "audit", "cluster", "tracking"]
    assert order == sorted(order, key=firsts.index), "a section's options are contiguous"


@pytest.mark.parametrize("cls", [TrainConfig, FederatedConfig])
def test_no_test_hook_is_an_option(cls):
    names = {f.name for f in dataclasses.fields(cls)}
    assert not {n for n in names if "fault" in n}
    p = argparse.ArgumentParser()
    add_config_arguments(p, cls)
    flags = [s for a in p._actions for s in a.option_strings]
    assert not [s for s in flags if "fault" in s]
    assert "testing" not in {g.title for g in p._action_groups}
    assert "for tests" not in p.format_help()


def test_yaml_may_give_options_by_section_or_flat(tmp_path):
    by_section = tmp_path / "a.yaml"
    by_section.write_text(
        "privacy:\n  target_epsilon: 3\n  lot_size: 256\nmodel:\n  model: cnn\n  lr: 0.1\nepochs: 5\n"
    )
    flat = tmp_path / "b.yaml"
    flat.write_text("target_epsilon: 3\nlot_size: 256\nmodel: cnn\nlr: 0.1\nepochs: 5\n")
    a, b = load_config(by_section), load_config(flat)
    assert a == b and a.target_epsilon == 3.0 and a.model == "cnn" and a.epochs == 5.0
    # a flag still wins over the file
    assert load_config(by_section, {"lr": 0.5}).lr == 0.5


def test_an_option_under_the_wrong_section_is_refused_with_its_home():
    with pytest.raises(
        dpcore.DPConfigError, match=r"section 'privacy' has no option 'lr' \(it belongs to section 'model'\)"
    ):
        config_from_dict({"privacy": {"lr": 0.1}})
    with pytest.raises(dpcore.DPConfigError, match="section 'data' has no option 'nope'"):
        config_from_dict({"data": {"nope": 1}})


def test_a_section_comes_out_typed_and_checks_itself():
    cfg = TrainConfig(target_epsilon=3.0, lot_size=128, num_workers=1, in_process=True)
    privacy = cfg.section(PrivacyConfig)
    assert isinstance(privacy, PrivacyConfig) and privacy.target_epsilon == 3.0 and privacy.lot_size == 128
    assert not hasattr(privacy, "num_workers")  # performance flags live apart from the mechanism
    assert cfg.section(ScaleConfig).in_process is True
    with pytest.raises(dpcore.DPConfigError, match="lot_size"):
        PrivacyConfig(lot_size=0).check()
    with pytest.raises(dpcore.DPConfigError, match="train_subset"):
        DataConfig(train_subset=-1).check()
    # and the composed config runs every section's check
    with pytest.raises(dpcore.DPConfigError, match="train_subset"):
        TrainConfig(train_subset=-1).validate()


def test_the_federated_config_shares_the_dataset_audit_and_tracking_sections():
    from pipelines.config import AuditOptions, DatasetOptions, TrackingOptions

    for shared in (DatasetOptions, AuditOptions, TrackingOptions):
        assert issubclass(FederatedConfig, shared) and issubclass(TrainConfig, shared)
    assert FederatedConfig().experiment == "dp-federated" and TrainConfig().experiment == "dp-training"
    with pytest.raises(dpcore.DPConfigError, match="dataset='nope' is unknown"):
        FederatedConfig(dataset="nope").validate()
    with pytest.raises(dpcore.DPConfigError, match="audit_canary_rate"):
        FederatedConfig(audit_canaries=10, audit_canary_rate=1.5).validate()
