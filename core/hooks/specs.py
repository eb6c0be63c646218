"""Every hook a plugin can implement, in one place.

A plugin is any module (or object) with functions decorated by ``llmserve.hookimpl`` whose
names match the specs below. Plugins are found through the ``llmserve`` entry-point group,
the YAML ``plugins:`` list and ``--plugin``. Keep hook arguments plain positional names:
pluggy passes arguments by name and silently ignores keyword-only or defaulted ones.

Contribution hooks (``register_*``) return records (see ``llmserve.hooks.records``) whose
``target`` is imported only when used, so keep plugin modules import-light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import typer

    from llmserve.hooks.records import (BackendSpec, GuidedDecoderSpec, ProposerSpec, ProtocolSpec,
                                         ReasoningParserSpec, ToolParserSpec)

hookspec = pluggy.HookspecMarker("llmserve")


@hookspec
def register_protocols() -> "list[ProtocolSpec]":
    """Contribute serving dialects.

    Return a list of ``ProtocolSpec`` records. Each ``target`` names a ``llmserve.server.protocol.Protocol``
    subclass whose ``router()`` holds the dialect's routes and whose ``error_response()``
    renders errors in the dialect's own format. Enabled dialects are chosen with
    ``--protocols``; two enabled dialects may not claim the same method and path.

    Example::

        @hookimpl
        def register_protocols():
            return [ProtocolSpec(name="acme", target="llmserve_acme.protocol:AcmeProtocol",
                                 description="Acme's /acme/generate route")]
    """


@hookspec
def register_backends() -> "list[BackendSpec]":
    """Contribute model runners.

    Return a list of ``BackendSpec`` records whose ``target`` is a
    ``llmserve.engine.backend.Backend`` subclass. The server instantiates the one named by
    ``--backend`` (default ``torch``) with the effective configuration.

    Example::

        @hookimpl
        def register_backends():
            return [BackendSpec(name="echo", target="my_pkg.echo:EchoBackend")]
    """


@hookspec
def register_tool_parsers() -> "list[ToolParserSpec]":
    """Contribute tool-call parsers, selected with ``--tool-call-parser NAME``.

    ``target`` names a parser class; the server makes a fresh instance per request.

    Example::

        @hookimpl
        def register_tool_parsers():
            return [ToolParserSpec(name="acme", target="my_pkg.parser:AcmeToolParser")]
    """


@hookspec
def register_reasoning_parsers() -> "list[ReasoningParserSpec]":
    """Contribute reasoning parsers, selected with ``--reasoning-parser NAME``.

    ``target`` names a parser class; the server makes a fresh instance per request.

    Example::

        @hookimpl
        def register_reasoning_parsers():
            return [ReasoningParserSpec(name="think", target="my_pkg.think:ThinkParser")]
    """


@hookspec
def register_guided_decoders() -> "list[GuidedDecoderSpec]":
    """Contribute guided-decoding backends (JSON schema, regex, choice, grammar constraints).

    ``target`` names a ``llmserve.guided.GuidedDecoder`` subclass whose ``kinds`` says which
    constraints it enforces. The server imports and builds one instance per decoder on the
    first request that needs it, as ``cls(tokenizer, vocab_size, eos_token_ids)``.
    ``--guided-decoding-backend NAME`` (default ``lm-format-enforcer``) picks the preferred
    decoder; a kind it does not support goes to another installed decoder that supports it.

    Example::

        @hookimpl
        def register_guided_decoders():
            return [GuidedDecoderSpec(name="acme-grammar", target="my_pkg.grammar:AcmeGrammarDecoder",
                                      description="GBNF grammars")]
    """


@hookspec
def register_proposers() -> "list[ProposerSpec]":
    """Contribute speculative-decoding proposers (guesses of the next tokens that the model verifies).

    ``target`` names a ``llmserve.Proposer`` subclass. ``--speculative-config '{"method": NAME,
    ...}'`` picks one by name; the server builds it once per model as ``cls(config, info)`` (the
    ``SpeculativeConfig``, whose extra keys are the method's own settings, and the target's
    ``ModelInfo``) and calls ``propose`` once per engine step with the sequences that may
    speculate. Proposals cost time only: every proposed token is verified by the model, so the
    output is what it would be without them.

    Example::

        @hookimpl
        def register_proposers():
            return [ProposerSpec(name="acme-lookup", target="my_pkg.lookup:AcmeLookup",
                                 description="proposes from a phrase table")]
    """


@hookspec
def register_commands(cli: "typer.Typer") -> None:
    """Add sub-commands to the ``llmserve`` CLI.

    Called once while the CLI is built, before arguments are parsed; only built-in and
    auto-discovered plugins (entry points) can add commands, since ``--plugin`` is parsed later.
    The built-in ``commands`` plugin (``llmserve.plugins.commands``) adds ``chat``, ``bench``
    and ``ray-serve`` this way. A command builds only on the names ``llmserve.cli`` exports
    (``with_config_options``, ``resolve_config``, ``PanelCommand``, ``fail``, ...).

    Example::

        @hookimpl
        def register_commands(cli):
            @cli.command()
            def hello():
                print("hello")
    """


@hookspec
def startup(context: Any) -> None:
    """Called once when the server has loaded the model and is about to accept requests.

    ``context`` is the ``llmserve.server.context.ServerContext`` (config, engine client,
    model info, registry). Raising here stops startup with the error's message.

    Example::

        @hookimpl
        def startup(context):
            context.state["acme_started"] = True
    """


@hookspec
def shutdown(context: Any) -> None:
    """Called once while the server shuts down, after requests have drained.

    Example::

        @hookimpl
        def shutdown(context):
            context.state.pop("acme_started", None)
    """
