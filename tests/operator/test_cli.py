"""routerfleet-operator render/validate: offline dry runs of the renderers."""

from __future__ import annotations

import yaml

from routerfleet_operator.cli import main

from .helpers import SAMPLES


def test_render_prints_every_manifest(capsys):
    assert main(["render", "-f", str(SAMPLES / "minimal.yaml"), "--namespace", "demo"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs][-1] == "Deployment"
    assert all(d["metadata"]["namespace"] == "demo" for d in docs)


def test_validate(tmp_path, capsys):
    assert main(["validate", "-f", str(SAMPLES / "full.yaml")]) == 0
    bad = yaml.safe_load((SAMPLES / "minimal.yaml").read_text())
    bad["spec"]["bootstrap"] = {"passVerdicts": ["warm"]}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert main(["validate", "-f", str(path)]) == 1
    assert "must include no_peers and fleet_cold" in capsys.readouterr().err
    assert main(["render", "-f", str(path)]) == 1


def test_bad_input_is_one_line_never_a_traceback(tmp_path, capsys):
    base = yaml.safe_load((SAMPLES / "minimal.yaml").read_text())
    assert main(["render", "-f", str(SAMPLES / "minimal.yaml"), "--token", ""]) == 2
    assert capsys.readouterr().err.strip() == "routerfleet-operator: --token: must not be empty"
    for spec in ([1], {**base["spec"], "router": {**base["spec"]["router"], "imagePullSecrets": [{}]}}):
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump({**base, "spec": spec}))
        assert main(["validate", "-f", str(path)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("routerfleet-operator: spec"), err
