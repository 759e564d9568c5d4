"""The code's shape, checked: the engine imports nothing above it, its parts stand in layers without a cycle, and
settings are read in one module only."""
from __future__ import annotations

import ast
import re
import subprocess
import sys

from streamlit.testing.v1 import AppTest

from engine.config import EngineConfig
from server.settings import ServerSettings, all_setting_names, load_settings
from server.slot import shutdown

from .conftest import ROOT

ABOVE_ENGINE = {"ui", "api", "bench", "pages", "app", "streamlit_app", "streamlit", "scale", "speed", "fixtures",
                "samples"}
# What the product is: it imports neither the measuring tools (bench/) nor what the tests make (fixtures/).
PRODUCT = ("", "engine", "api", "server", "ui", "pages", "scale", "speed", "samples")


def _python_files(*folders: str):
    for folder in folders:
        yield from sorted((ROOT / folder).rglob("*.py")) if folder else sorted(ROOT.glob("*.py"))


def test_engine_is_the_inference_core_and_imports_nothing_above_it():
    for path in _python_files("engine"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for name in names:
                assert name.split(".")[0] not in ABOVE_ENGINE, f"{path.relative_to(ROOT)} imports {name}"
        assert "app:app" not in path.read_text(), path
    assert not {"bench.py", "tuning.py", "soak.py", "advisor.py"} & {p.name for p in (ROOT / "engine").iterdir()}


def _imports(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_the_api_and_the_shared_server_state_do_not_import_the_ui():
    """The API serves without the UI: it reaches the engine through server/, which draws nothing."""
    for path in _python_files("api", "server"):
        assert not _imports(path) & {"ui", "pages"}, f"{path.relative_to(ROOT)} imports the UI"
    for path in _python_files("server"):
        drawn = set(re.findall(r"\bst\.(\w+)", path.read_text())) - {"secrets", "get_option", "App"}
        assert not drawn, f"{path.relative_to(ROOT)} draws with st.{drawn}"


def test_the_product_imports_neither_the_measuring_tools_nor_the_test_fixtures():
    """bench/ measures the product and fixtures/ makes what tests feed it: the app, the API and a replica run from
    what they import without either."""
    for path in _python_files(*PRODUCT):
        assert not _imports(path) & {"bench", "fixtures", "tests"}, f"{path.relative_to(ROOT)} imports a tool"


def test_only_the_scale_out_imports_ray_and_nothing_imports_the_scale_out():
    """Ray is optional (requirements-scale.txt): the app, the API and the engine run without it."""
    for path in _python_files(*[folder for folder in PRODUCT if folder != "scale"], "bench", "fixtures"):
        assert not _imports(path) & {"ray", "scale"}, f"{path.relative_to(ROOT)} imports Ray or the scale-out"


def _reads_vlscope_variable(node: ast.AST) -> bool:
    """os.environ["VLSCOPE_X"], os.environ.get("VLSCOPE_X") or os.getenv("VLSCOPE_X")."""
    def vlscope_constant(value):
        return isinstance(value, ast.Constant) and isinstance(value.value, str) and value.value.startswith("VLSCOPE_")
    if isinstance(node, ast.Subscript) and "environ" in ast.unparse(node.value):
        return vlscope_constant(node.slice)
    if isinstance(node, ast.Call) and re.search(r"environ\.get|getenv", ast.unparse(node.func)):
        return bool(node.args) and vlscope_constant(node.args[0])
    return False


def test_no_module_but_the_settings_module_reads_vlscope_variables():
    readers = [str(path.relative_to(ROOT)) for path in _python_files(*PRODUCT, "bench", "fixtures")
               if any(_reads_vlscope_variable(node) for node in ast.walk(ast.parse(path.read_text())))]
    # engine/config.py reads every setting by the name it derives from the field; engine/machine.py the hold of the
    # CPU's flags to AVX2 that measurements set beside the libraries' own; fixtures/places.py where the tests' and
    # tools' folders and Chromium are.
    assert readers == ["engine/machine.py", "fixtures/places.py"]


def test_the_configuration_page_documents_exactly_the_settings_there_are():
    table = [line for line in (ROOT / "docs" / "configuration.md").read_text().splitlines()
             if line.startswith("| `VLSCOPE_")]
    documented = {name for line in table for name in re.findall(r"`(VLSCOPE_\w+)`", line.split("|")[1])}
    names = set(all_setting_names()) - {"VLSCOPE_DB_PATH"} | {"VLSCOPE_DB"}  # the database's shorter name
    assert documented == names


def _sample_value(field_type: str, default):
    """A valid value unlike the default, as a secrets file would hold it."""
    if field_type == "bool":
        return not default
    if field_type == "int":
        return default + 7 if default else 3
    if field_type == "float":
        return 0.5
    if field_type.startswith("tuple"):
        return ["first", "second"]
    return f"{default}-changed" if default else "changed"


def test_every_setting_takes_effect_from_secrets_and_the_environment_wins():
    import dataclasses

    special = {"dtype": "int8", "compute_dtype": "float32", "kernels": "plain", "compile": "off", "draft": "off", "min_pixels": 4096,
               "max_pixels": 2_000_000, "temperature": 0.7, "top_p": 0.5}
    for cls, part in ((EngineConfig, "engine"), (ServerSettings, "server")):
        for field in dataclasses.fields(cls):
            default = getattr(cls(), field.name)
            value = special.get(field.name, _sample_value(field.type, default))
            settings = getattr(load_settings(env={}, secrets={field.name: value}), part)
            expected = tuple(value) if isinstance(value, list) else value
            assert getattr(settings, field.name) == expected != default, field.name
    both = load_settings(env={"VLSCOPE_MAX_QUEUE": "5"}, secrets={"max_queue": 2})
    assert both.engine.max_queue == 5


def test_the_app_reads_its_settings_from_st_secrets(tiny_model, tmp_path, monkeypatch):
    monkeypatch.delenv("VLSCOPE_APP_PASSWORD", raising=False)
    shutdown()
    try:
        at = AppTest.from_file(str(ROOT / "streamlit_app.py"), default_timeout=120)
        at.secrets["vlscope"] = {"model": str(tiny_model), "db_path": str(tmp_path / "s.db"), "warmup": False,
                                 "app_password": "sesame", "admin_password": "boss", "max_new_tokens": 7}
        at.run()
        assert at.text_input(key="sign_in_password")  # the password from secrets guards the app
        at.text_input(key="sign_in_password").set_value("sesame")
        at.button(key="sign_in_submit").click().run()
        assert not at.exception
        at.switch_page("pages/settings.py").run()
        at.text_input(key="admin_password").set_value("boss")
        at.button(key="admin_submit").click().run()
        assert at.number_input(key="set_max_new").value == 7
    finally:
        shutdown()


# The engine's parts, lowest first: a part imports its own modules and those of parts below it, never one above.
# The face (engine/*.py) imports any part; a part imports of the face only its leaves, which import no part.
ENGINE_PARTS = ("inputs", "records", "kernels", "model", "structured", "core")
FACE_LEAVES = {"engine.config", "engine.errors", "engine.machine", "engine.request"}


def _engine_module(path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _engine_imports(path) -> set[str]:
    """Every engine module `path` imports, at the top, inside functions or under TYPE_CHECKING alike."""
    module = _engine_module(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            candidates = [name] + [f"{name}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        for candidate in candidates:
            file = ROOT / candidate.replace(".", "/")
            if candidate.split(".")[0] == "engine" and (file.with_suffix(".py").is_file() or (file / "__init__.py").is_file()):
                found.add(candidate)
    return found - {module}


def _engine_graph() -> dict[str, set[str]]:
    return {_engine_module(path): _engine_imports(path) for path in _python_files("engine")}


def test_the_engine_has_no_import_cycle():
    graph = _engine_graph()
    for start in graph:
        seen, frontier = set(), list(graph[start])
        while frontier:
            module = frontier.pop()
            assert module != start, f"{start} reaches itself through its imports"
            if module not in seen:
                seen.add(module)
                frontier.extend(graph.get(module, ()))


def _part(module: str) -> str | None:
    name = module.split(".")
    return name[1] if len(name) > 2 or (len(name) == 2 and name[1] in ENGINE_PARTS) else None


def test_no_part_of_the_engine_imports_one_above_it():
    graph = _engine_graph()
    assert {_part(module) for module in graph} - {None} == set(ENGINE_PARTS)
    for module, imported in graph.items():
        part = _part(module)
        for name in imported:
            if part is None and module not in FACE_LEAVES:
                continue  # the face: the client, remote engine, protocol and command line use every part
            target = _part(name)
            if target is None:
                assert name in FACE_LEAVES and not {_part(n) for n in graph[name]} - {None}, f"{module} imports {name}"
            else:
                assert part is not None and ENGINE_PARTS.index(target) <= ENGINE_PARTS.index(part), \
                    f"{module} imports {name}, a part above it"


def test_every_part_says_in_one_line_what_it_is():
    for part in ENGINE_PARTS:
        tree = ast.parse((ROOT / "engine" / part / "__init__.py").read_text())
        docstring = ast.get_docstring(tree)
        assert docstring and "\n" not in docstring and len(tree.body) == 1, part


def test_the_client_imports_no_torch():
    """The engine's face, its client, the remote engine and the protocol start without torch or transformers: the
    command line's help, a remote backend and the API's light paths pay for neither."""
    script = ("import sys, engine, engine.client, engine.remote, engine.serving, engine.__main__; "
              "print(sorted(name for name in ('torch', 'transformers') if name in sys.modules))")
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def _calls(path, name: str) -> bool:
    return any(isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == name
               for node in ast.walk(ast.parse(path.read_text())))


def test_one_module_chooses_the_decode_backend():
    for name in ("DirectDecodeStep", "compile_step", "pack_remaining_linears"):
        callers = {str(path.relative_to(ROOT)) for path in _python_files("engine") if _calls(path, name)}
        allowed = {"engine/model/decode_backend.py"} | ({"engine/model/loading.py"} if name == "pack_remaining_linears"
                                                        else set())  # loading packs the vision tower alone
        assert callers <= allowed and "engine/model/decode_backend.py" in callers, (name, callers)


def test_no_stop_iteration_drives_the_engine_and_no_class_is_over_300_lines():
    for path in _python_files("engine"):
        tree = ast.parse(path.read_text())
        assert "StopIteration" not in path.read_text(), path
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno - node.lineno < 300, f"{path.relative_to(ROOT)}: {node.name}"


def test_the_api_and_the_records_load_without_streamlit_or_torch():
    """A cluster's replica, or a server fronting a remote backend, loads torch only with a local engine, and
    Streamlit never: the API, the shared server state and the records need neither (a fresh process shows it)."""
    loaded = subprocess.run([sys.executable, "-c", (
        "import sys, api.app, api.routes, server.slot, engine.remote, engine.records.store, engine.records.trace; "
        "print(sorted(name for name in ('streamlit', 'torch', 'transformers') if name in sys.modules))")],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr[-2000:]


def test_the_core_reaches_the_model_through_the_runner_only():
    """The engine core plans and steps; the model runner (engine/model/runner.py) encodes, prefills and decodes:
    the core neither imports the model's stages nor reaches into the loaded model or the decode step."""
    graph = _engine_graph()
    for path in _python_files("engine/core"):
        module = _engine_module(path)
        reached = {name for name in graph[module] if _part(name) in ("model", "kernels")}
        assert reached <= {"engine.model.runner", "engine.model.runner.ModelRunner", "engine.model.memory_pages",
                           "engine.model.memory_pages.release_freed_memory", "engine.kernels.memory_read",
                           "engine.kernels.memory_read.memory_read_gb_per_s"}, (module, reached)
        text = path.read_text()
        for reach in ("loaded.model", ".decode_step", "DirectDecodeStep", "isinstance(core."):
            assert reach not in text, f"{path.relative_to(ROOT)} reaches into the model: {reach}"
