"""The user's own model names and folders (formats/names.py): a name runs the model it was made
from (by `resolve_model`, so serve, generate and LLM), `models list` shows it and `models rm`
removes it (the model stays); folders set once, by the environment or the file, are searched by
`models list` and by every model name, their models under short names."""

import json
import shutil

import pytest

from scratchllm.cli.main import main
from scratchllm.errors import ConfigError
from scratchllm.formats import names
from scratchllm.formats.refs import resolve_model


@pytest.fixture
def no_stores(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hf"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "no-ollama"))


def test_a_name_runs_its_model_and_is_listed_and_removed(no_stores, default_gguf, capsys):
    names.save(names.Named("mybot", "default", system="Be brief.", parameters={"temperature": 0.2}))
    names.save(names.Named("other", "mybot"))
    assert names.lookup("mybot").name == "mybot:latest" and names.lookup("mybot:latest").system == "Be brief."
    assert resolve_model("mybot") == resolve_model("other:latest") == default_gguf
    assert main(["models", "list", "--json"]) == 0
    listed = {m["name"]: m for m in json.loads(capsys.readouterr().out)["models"]}
    assert listed["mybot:latest"]["store"] == "name" and listed["mybot:latest"]["path"] == str(default_gguf)
    assert listed["mybot:latest"]["state"] == "from default (with its system, parameters)"
    assert main(["models", "rm", "mybot", "--yes"]) == 0
    assert "removed the name mybot:latest; default stays" in capsys.readouterr().out
    assert names.lookup("mybot") is None and default_gguf.exists()
    with pytest.raises(ConfigError, match="no model at 'mybot'"):
        resolve_model("other")  # its model's name is gone


def test_names_in_a_circle_are_refused():
    names.save(names.Named("a", "b:latest"))
    names.save(names.Named("b", "a:latest"))
    with pytest.raises(ConfigError, match="circle"):
        resolve_model("a")


def test_folders_set_once_are_searched_by_short_names(no_stores, tmp_path, monkeypatch, default_gguf, capsys):
    env_dir, file_dir = tmp_path / "env-models", tmp_path / "file-models"
    (env_dir / "smol").mkdir(parents=True)
    file_dir.mkdir()
    shutil.copy(default_gguf, env_dir / "smol" / "smol.gguf")
    shutil.copy(default_gguf, file_dir / "other.gguf")
    monkeypatch.setenv("SCRATCHLLM_MODEL_DIRS", str(env_dir))
    (names.config_dir()).mkdir(parents=True, exist_ok=True)
    (names.config_dir() / names.FILE).write_text(json.dumps({"names": {}, "dirs": [str(file_dir)]}))
    assert names.model_dirs() == [env_dir, file_dir]
    assert resolve_model("smol/smol.gguf") == env_dir / "smol" / "smol.gguf"
    assert resolve_model("other.gguf") == file_dir / "other.gguf"
    assert main(["models", "list", "--json"]) == 0
    listed = {m["name"]: m for m in json.loads(capsys.readouterr().out)["models"]}
    assert listed["smol/smol.gguf"]["store"] == "folder"
    assert listed["other.gguf"]["path"] == str(file_dir / "other.gguf")


def test_a_broken_names_file_is_one_clear_error():
    names.config_dir().mkdir(parents=True, exist_ok=True)
    (names.config_dir() / names.FILE).write_text("{not json")
    with pytest.raises(ConfigError, match="not a JSON file of model names"):
        names.all_names()
