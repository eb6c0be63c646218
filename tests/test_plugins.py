"""Plugin loading: specs, order, blocking, failure policy, duplicates, lazy records."""

import json
import re
import sys
import textwrap

import pytest

from conftest import ECHO_PLUGIN, run_cli
from llmserve.hooks.records import ToolParserSpec
from llmserve.errors import ConfigError, PluginLoadError
from llmserve.hooks.manager import PluginManager
from llmserve.hooks.registry import Registry


def make_plugin(tmp_path, name, body):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return path


PARSER_PLUGIN = """
from llmserve import hookimpl
from llmserve.hooks.records import ToolParserSpec

@hookimpl
def register_tool_parsers():
    return [ToolParserSpec(name="{name}", target="x:Y"{extra})]
"""


def test_builtins_load_through_entry_points():
    pm = PluginManager().load(autoload=False)
    assert pm.infos["ops"].source == "builtin"
    assert pm.infos["ops"].distribution == "llmserve"
    assert "ops" in Registry.collect(pm).names("protocol")


def test_plugin_from_file_path_contributes_backend():
    pm = PluginManager().load([(ECHO_PLUGIN, "cli")], autoload=False)
    reg = Registry.collect(pm)
    assert "echo" in reg.names("backend")
    assert reg.get("backend", "echo").plugin == "echo_backend"
    assert reg.load("backend", "echo").__name__ == "EchoBackend"


def test_plugin_from_module_and_module_attr(tmp_path, monkeypatch):
    make_plugin(tmp_path, "modplug", PARSER_PLUGIN.format(name="modparser", extra=""))
    (tmp_path / "objplug.py").write_text(textwrap.dedent("""
        from llmserve import hookimpl
        from llmserve.hooks.records import ToolParserSpec
        class Plugin:
            @hookimpl
            def register_tool_parsers(self):
                return ToolParserSpec(name="objparser", target="x:Y")
        plugin = Plugin()
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    pm = PluginManager().load([("modplug", "cli"), ("objplug:plugin", "cli")], autoload=False)
    names = Registry.collect(pm).names("tool_parser")
    assert "modparser" in names and "objparser" in names


def test_blocking_a_builtin():
    pm = PluginManager().load([("no:ops", "cli")], autoload=False)
    assert "ops" not in pm.infos
    assert "ops" not in Registry.collect(pm).names("protocol")


def test_explicit_broken_plugin_fails_with_one_clear_line(tmp_path):
    bad = make_plugin(tmp_path, "broken", "import does_not_exist_anywhere\n")
    with pytest.raises(PluginLoadError) as err:
        PluginManager().load([(str(bad), "cli")], autoload=False)
    assert "broken.py" in str(err.value) and "does_not_exist_anywhere" in str(err.value)
    with pytest.raises(PluginLoadError, match="no such file"):
        PluginManager().load([(str(tmp_path / "missing.py"), "cli")], autoload=False)
    with pytest.raises(PluginLoadError, match="no_such_module_xyz"):
        PluginManager().load([("no_such_module_xyz", "cli")], autoload=False)
    result = run_cli("serve", "--plugin", str(bad))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: cannot load plugin '{bad}': ModuleNotFoundError: "
                                                  "No module named 'does_not_exist_anywhere'"]


def fake_distribution(root, dist, entry_points, modules):
    """Write a dist-info with entry points onto a directory that goes on sys.path."""
    info = root / f"{dist}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[llmserve]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
    for name, text in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(text))


def test_autodiscovered_broken_plugin_warns_and_the_rest_load(tmp_path):
    fake_distribution(tmp_path, "broken_dist", {"brokenep": "brokenmod"}, {"brokenmod": "raise RuntimeError('boom')\n"})
    fake_distribution(tmp_path, "good_dist", {"goodep": "goodmod"},
                      {"goodmod": PARSER_PLUGIN.format(name="goodparser", extra="")})
    result = run_cli("plugins", "--json", env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "plugin 'brokenep' (brokenmod) failed to load: RuntimeError: boom" in result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert rows["goodep"]["contributes"] == {"tool_parser": ["goodparser"]}
    assert rows["goodep"]["distribution"] == "good_dist" and rows["goodep"]["version"] == "1.0"
    assert rows["brokenep"]["error"] == "RuntimeError: boom"
    assert rows["ops"]["source"] == "builtin"
    # Autoload off: the third-party entry points are not loaded, built-ins still are...
    off = run_cli("plugins", "--json", env={"PYTHONPATH": str(tmp_path), "LLMSERVE_DISABLE_PLUGIN_AUTOLOAD": "1"})
    names = {row["name"] for row in json.loads(off.stdout)}
    assert "goodep" not in names and "brokenep" not in names and "ops" in names
    # ...but naming an entry point explicitly still loads it, and a broken one then fails hard.
    named = run_cli("plugins", "--json", "--plugin", "goodep",
                    env={"PYTHONPATH": str(tmp_path), "LLMSERVE_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert "goodep" in {row["name"] for row in json.loads(named.stdout)}
    hard = run_cli("plugins", "--plugin", "brokenep",
                   env={"PYTHONPATH": str(tmp_path), "LLMSERVE_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert hard.returncode == 2 and "brokenep" in hard.stderr and "boom" in hard.stderr


def test_duplicate_names_error_names_both(tmp_path):
    one = make_plugin(tmp_path, "one", PARSER_PLUGIN.format(name="same", extra=""))
    two = make_plugin(tmp_path, "two", PARSER_PLUGIN.format(name="same", extra=""))
    pm = PluginManager().load([(str(one), "cli"), (str(two), "cli")], autoload=False)
    with pytest.raises(PluginLoadError) as err:
        Registry.collect(pm)
    assert "tool parser 'same'" in str(err.value)
    assert "'one'" in str(err.value) and "'two'" in str(err.value)


def test_override_wins_in_either_order(tmp_path):
    plain = make_plugin(tmp_path, "plain", PARSER_PLUGIN.format(name="same", extra=""))
    over = make_plugin(tmp_path, "over", PARSER_PLUGIN.format(name="same", extra=", overrides=True"))
    for order in ([plain, over], [over, plain]):
        pm = PluginManager().load([(str(p), "cli") for p in order], autoload=False)
        assert Registry.collect(pm).get("tool_parser", "same").plugin == "over"
        for mod in ("llmserve_plugin_plain", "llmserve_plugin_over"):
            sys.modules.pop(mod, None)


def test_unknown_contribution_lists_available():
    reg = Registry.collect(PluginManager().load(autoload=False))
    with pytest.raises(ConfigError, match="unknown backend 'nope'; available:"):
        reg.get("backend", "nope")


def test_records_are_lazy():
    record = ToolParserSpec(name="x", target="json:dumps")
    assert record.kind == "tool_parser"
    import json as json_module
    assert record.load() is json_module.dumps


def test_help_and_plugins_never_import_torch_or_transformers():
    code = ("import sys\nfrom llmserve.cli import main\n"
            "for argv in (['--help'], ['plugins'], ['plugins', '--json'], ['serve', '--help'], ['config', 'show']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('HEAVY', [m for m in ('torch', 'transformers') if m in sys.modules])\n")
    import subprocess
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr


def test_register_commands_from_an_entry_point_plugin(tmp_path):
    fake_distribution(tmp_path, "cmd_dist", {"cmdep": "cmdmod"}, {"cmdmod": """
        from llmserve import hookimpl

        @hookimpl
        def register_commands(cli):
            @cli.command()
            def hello(name: str = "world"):
                print(f"hello {name}")
    """})
    result = run_cli("hello", "--name", "plugins", env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "hello plugins"


def listed_commands(help_text: str) -> set[str]:
    """The command names of ``llmserve --help``."""
    return set(re.findall(r"^  ([a-z][\w-]*)(?=\s|$)", help_text.split("Commands:")[1], re.M))


def test_commands_come_and_go_with_their_plugin(tmp_path):
    """chat, bench and ray-serve come from the built-in ``commands`` plugin, which always loads;
    with autoload off, an installed plugin's command is gone."""
    fake_distribution(tmp_path, "greet_dist", {"greetep": "greetmod"}, {"greetmod": """
        from llmserve import hookimpl

        @hookimpl
        def register_commands(cli):
            @cli.command()
            def greet():
                print("hi")
    """})
    on = {"PYTHONPATH": str(tmp_path)}
    off = {**on, "LLMSERVE_DISABLE_PLUGIN_AUTOLOAD": "1"}
    assert listed_commands(run_cli("--help", env=on).stdout) >= {"chat", "bench", "ray-serve", "greet"}
    without = listed_commands(run_cli("--help", env=off).stdout)
    assert {"chat", "bench", "ray-serve", "serve"} <= without and "greet" not in without
    gone = run_cli("greet", env=off)
    assert gone.returncode == 2 and "No such command 'greet'" in gone.stderr
    rows = {row["name"]: row for row in json.loads(run_cli("plugins", "--json", env=off).stdout)}
    assert rows["commands"]["source"] == "builtin" and rows["commands"]["module"] == "llmserve.plugins.commands"


def test_register_reasoning_parsers_and_aliases(tmp_path):
    plugin = make_plugin(tmp_path, "think", """
        from llmserve import hookimpl
        from llmserve.hooks.records import ReasoningParserSpec

        @hookimpl
        def register_reasoning_parsers():
            return [ReasoningParserSpec(name="think", target="json:loads", aliases=("think_v2",))]
    """)
    reg = Registry.collect(PluginManager().load([(str(plugin), "cli")], autoload=False))
    assert "think" in reg.names("reasoning_parser")
    assert reg.get("reasoning_parser", "think_v2").record.name == "think"
    assert reg.load("reasoning_parser", "think") is json.loads


def test_misspelled_hook_is_an_error(tmp_path):
    plugin = make_plugin(tmp_path, "typo", """
        from llmserve import hookimpl

        @hookimpl
        def register_protocol():
            return []
    """)
    with pytest.raises(PluginLoadError, match="plugin 'typo'.*register_protocol"):
        PluginManager().load([(str(plugin), "cli")], autoload=False)
