"""deploy/: the RayService manifest's Serve config against Ray Serve's own config schema, its
entry point building the application, its sizes adding up, and the Containerfile's inputs."""

from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is not installed")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def manifest():
    return yaml.safe_load((ROOT / "deploy" / "rayservice.yaml").read_text())


def test_the_serve_config_is_valid_for_serve_and_builds_the_application(manifest):
    from ray.serve import Application
    from ray.serve.schema import ServeDeploySchema

    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    schema = ServeDeploySchema.model_validate(config) if hasattr(ServeDeploySchema, "model_validate") \
        else ServeDeploySchema.parse_obj(config)
    (app,) = schema.applications
    module, _, attr = app.import_path.partition(":")
    builder = getattr(__import__(module, fromlist=[attr]), attr)
    assert isinstance(builder(dict(app.args)), Application)  # builds without a cluster (nothing deployed)


def test_the_ray_version_and_the_sizes_agree(manifest):
    pinned = (ROOT / "requirements" / "cluster.txt").read_text()
    assert f"ray[serve]=={manifest['spec']['rayClusterConfig']['rayVersion']}" in pinned
    args = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"][0]["args"]
    workers = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    cpus = int(workers["rayStartParams"]["num-cpus"]) * workers["replicas"]
    assert cpus >= args["replicas"] * args["replica_cpus"], "the worker pods cannot hold the replicas"


def test_unknown_builder_args_are_refused():
    from scratchllm.cluster.app import app_builder
    from scratchllm.errors import ConfigError

    with pytest.raises(ConfigError, match="replica_count"):
        app_builder({"replica_count": 2})


def test_the_containerfile_copies_what_exists():
    lines = (ROOT / "deploy" / "Containerfile").read_text().splitlines()
    # from the build context; `COPY --from=STAGE` copies from an earlier stage of the image
    copied = [part for line in lines if line.startswith("COPY ") and "--from=" not in line
              for part in line.split()[1:-1]]
    assert copied and all((ROOT / p).exists() for p in copied), copied


def test_the_image_runs_a_wheel_without_a_compiler_or_the_extras():
    """The compiler stays in the stage that builds the wheel (every x86-64 level of the kernels);
    what runs installs that wheel, what serving needs and the cluster extra, nothing else."""
    text = (ROOT / "deploy" / "Containerfile").read_text()
    build, run = text.rsplit("\nFROM ", 1)
    assert "build-essential" in build and "pip wheel" in build and "SCRATCHLLM_NATIVE" not in text
    assert "build-essential" not in run and "gcc" not in run and "extras.txt" not in run
    assert "COPY --from=wheel /wheels" in run and "requirements/cluster.txt" in run
