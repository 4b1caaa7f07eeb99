"""Live A/B experiments: the experiment file and sticky weighted assignment (a server running one
is tested in-process: test_inprocess_experiments.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from ragspeed.gateway.errors import APIError
from ragspeed.gateway.experiments import (
    HOLDOUT_ARM,
    ArmError,
    ArmHints,
    ExperimentArm,
    LiveExperiment,
    load_experiment,
)
from ragspeed.gateway.protocol import ChatCompletionRequest

REPO = Path(__file__).resolve().parents[2]

EXPERIMENT = """\
name: exp1
sticky_by: user
holdout: {share: 0.1}
arms:
  a: {weight: 3}
  b: {weight: 1, ragspeed: {compression: {rate: 0.5}}}
"""


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def experiment(tmp_path) -> LiveExperiment:
    return LiveExperiment(load_experiment(write(tmp_path / "e.yaml", EXPERIMENT)), seed=0)


def test_weighted_sticky_split_with_holdout(experiment):
    counts = Counter(experiment.assign(f"user-{i}", ArmHints()).name for i in range(1000))
    assert counts == {"a": 674, "b": 249, HOLDOUT_ARM: 77}
    # Sticky: the same caller always gets the same arm.
    assert {experiment.assign("user-7", ArmHints()).name for _ in range(20)} == {
        experiment.assign("user-7", ArmHints()).name
    }
    summary = experiment.summary()
    assert (
        summary["arms"]["a"]["share"],
        summary["arms"]["b"]["share"],
        summary["arms"][HOLDOUT_ARM]["share"],
    ) == (0.675, 0.225, 0.1)
    assert summary["arms"]["a"]["assigned"] == 674 + 21


def test_sticky_by_api_key_and_override(tmp_path):
    spec = load_experiment(
        write(tmp_path / "k.yaml", "sticky_by: api_key\narms: {x: {weight: 1}, y: {weight: 1}}\n")
    )
    assert spec.name == "k" and spec.holdout_share == 0.0
    live = LiveExperiment(spec)
    by_key = {live.assign(f"u{i}", ArmHints(api_key_hash="h1")).name for i in range(10)}
    assert len(by_key) == 1  # the key decides, not the user field
    assert live.assign("u", ArmHints(override="y")).name == "y"
    with pytest.raises(APIError) as exc:
        live.assign("u", ArmHints(override="z"))
    assert (exc.value.status_code, exc.value.param) == (400, "x-ragspeed-arm")
    with pytest.raises(APIError, match="unknown arm 'holdout'"):
        live.assign("u", ArmHints(override=HOLDOUT_ARM))  # no holdout in this experiment


def test_arm_options_win_over_the_client():
    arm = ExperimentArm("b", 1.0, ragspeed={"compression": {"rate": 0.5}})
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "q"}],
            "ragspeed": {"compression": False, "return_prompt": True},
        }
    )
    applied = arm.apply(req)
    assert applied.ragspeed.compression.rate == 0.5 and applied.ragspeed.return_prompt is True
    assert req.ragspeed.compression is False  # the request itself is not mutated


@pytest.mark.parametrize(
    "text, line, message",
    [
        (
            "arms:\n  a: {weight: 0}\n  b: {weight: 0}\n",
            1,
            "key 'arms': the arms' weights must sum to a positive number",
        ),
        ("arms:\n  a:\n    weight: -1\n", 3, "key 'arms.a.weight': must lie in [0.0, inf]"),
        ("arms:\n  a:\n    weight: lots\n", 3, "key 'arms.a.weight': must be a number"),
        ("name: e\nsticky: user\narms: {a: {}}\n", 2, "key 'sticky': unknown key"),
        ("sticky_by: cookie\narms: {a: {}}\n", 1, "key 'sticky_by': must be one of user, api_key, none"),
        ("holdout: {share: 0.9}\narms: {a: {}}\n", 1, "key 'holdout.share': must lie in [0.0, 0.5]"),
        ("arms:\n  a:\n    weigth: 1\n", 3, "key 'arms.a.weigth': unknown key"),
        (
            "arms:\n  a:\n    ragspeed:\n      compression: {rate: 3}\n",
            4,
            "key 'arms.a.ragspeed.compression.rate': Input should be less than or equal to 1",
        ),
        ("arms:\n  a:\n    engine:\n      block_size: 0\n", 4, "key 'arms.a.engine.block_size'"),
        ("arms:\n  holdout: {}\n", 2, "'holdout' is reserved"),
        ("arms: []\n", 1, "key 'arms': must map arm names"),
    ],
)
def test_bad_experiment_files(tmp_path, text, line, message):
    path = write(tmp_path / "bad.yaml", text)
    with pytest.raises(ArmError) as exc:
        load_experiment(path, {})
    assert str(exc.value).startswith(f"{path}:{line}: ")
    assert message in str(exc.value)


def test_example_live_experiment_loads():
    spec = load_experiment(REPO / "examples/ab/live_experiment.yaml")
    assert (spec.name, [a.name for a in spec.arms], spec.holdout_share) == (
        "compression-4x",
        ["control", "compressed"],
        0.05,
    )
