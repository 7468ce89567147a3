"""kvlife's SGLang plugin: a launched SGLang server builds kvlife's decode offload manager.

SGLang 0.5.23 loads the setuptools entry points of the group ``sglang.srt.plugins`` at the
start of every process it launches (each scheduler process, before its ``Scheduler`` is
built; also the engine, the detokenizer and the DP controller), then applies the hooks they
registered. kvlife's distribution has one, named ``kvlife``, pointing at
[`register`][kvlife.offload.engines.sglang_plugin.register]. It does nothing unless the
operator turns it on::

    KVLIFE_SGLANG_OFFLOAD=1 python -m sglang.launch_server ... \\
        --disaggregation-mode decode --disaggregation-decode-enable-offload-kvcache ...

With the switch on, SGLang's ``DecodeKVCacheOffloadManager`` is replaced (a class
``REPLACE`` in SGLang's ``HookRegistry``) by
[`ServerDecodeOffloadManager`][kvlife.offload.engines.sglang.ServerDecodeOffloadManager]:
the scheduler constructs it with the arguments it passes SGLang's manager, and each
scheduler process writes its own audit log, named after its rank. Nothing else of SGLang's
command line changes.

Settings (environment variables; none starts with ``SGL``, which SGLang warns about):

* ``KVLIFE_SGLANG_OFFLOAD``: ``1``/``true``/``on`` to switch, ``0``/``false``/``off`` or
  unset to leave SGLang's own manager.
* ``KVLIFE_AUDIT_DIR``: the directory of the per-rank audit logs (default
  ``kvlife-audit`` in the server's working directory; made if missing).
* ``KVLIFE_AUDIT_FLUSH_S``: seconds between fsyncs of the logs (default ``1.0``). Every
  manager call also writes its records to the file when it returns, so a scheduler that is
  killed loses none of the records of the calls that returned.

This module imports nothing from SGLang or torch until the switch is on, so a process in
which it is off pays one environment lookup.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

#: The SGLang releases this plugin was tested on (exact versions: the scheduler's
#: construction call and the manager's methods are internal to SGLang).
TESTED_SGLANG = ("0.5.23",)

#: What the plugin replaces, as SGLang's ``HookRegistry`` names it.
TARGET = "sglang.srt.disaggregation.decode_kvcache_offload_manager.DecodeKVCacheOffloadManager"

SWITCH = "KVLIFE_SGLANG_OFFLOAD"
AUDIT_DIR = "KVLIFE_AUDIT_DIR"
AUDIT_FLUSH_S = "KVLIFE_AUDIT_FLUSH_S"

_ON = frozenset({"1", "true", "on", "yes"})
_OFF = frozenset({"", "0", "false", "off", "no"})


class PluginSettingsError(ValueError):
    """A ``KVLIFE_*`` setting of the SGLang plugin has a value it cannot use."""


class UnsupportedSGLangError(RuntimeError):
    """The plugin is switched on in an SGLang release it was not tested on; SGLang's own
    manager is left in place."""


@dataclass(frozen=True)
class PluginSettings:
    """The plugin's settings, read from the environment by
    [`from_env`][kvlife.offload.engines.sglang_plugin.PluginSettings.from_env]."""

    enabled: bool
    audit_dir: Path
    flush_interval_s: float

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PluginSettings:
        """The settings in ``environ`` (default ``os.environ``).

        Raises:
            PluginSettingsError: a switch value that is neither on nor off, or a flush
                interval that is not a positive number; the message names the variable and
                the value.
        """
        env = os.environ if environ is None else environ
        raw = env.get(SWITCH, "").strip().lower()
        if raw not in _ON | _OFF:
            raise PluginSettingsError(
                f"{SWITCH}={env[SWITCH]!r}: use 1 (kvlife's decode offload manager) or 0 "
                "(SGLang's own)"
            )
        flush_raw = env.get(AUDIT_FLUSH_S, "1.0")
        try:
            flush = float(flush_raw)
        except ValueError:
            flush = float("nan")
        if not flush > 0 or flush == float("inf"):
            raise PluginSettingsError(
                f"{AUDIT_FLUSH_S}={flush_raw!r}: seconds between fsyncs, a positive number"
            )
        audit_dir = Path(env.get(AUDIT_DIR) or "kvlife-audit")
        return cls(enabled=raw in _ON, audit_dir=audit_dir, flush_interval_s=flush)


def rank_name(tp_rank: int, pp_rank: int = 0, pp_size: int = 1, dp_rank: int | None = None) -> str:
    """A scheduler process's name in its audit log's file name: ``tp0``, ``pp1-tp0``,
    ``dp2-tp1`` (the pipeline stage only when there are several, the data-parallel
    replica only under a DP controller)."""
    parts = [] if dp_rank is None else [f"dp{dp_rank}"]
    if pp_size > 1:
        parts.append(f"pp{pp_rank}")
    parts.append(f"tp{tp_rank}")
    return "-".join(parts)


def audit_log_path(settings: PluginSettings, rank: str) -> Path:
    """The audit log of the scheduler process named ``rank``: ``DIR/sglang-RANK.jsonl``."""
    return settings.audit_dir / f"sglang-{rank}.jsonl"


def register() -> bool:
    """The ``sglang.srt.plugins`` entry point (SGLang's ``load_plugins()`` calls it once
    per process): with ``KVLIFE_SGLANG_OFFLOAD`` on, register kvlife's manager as the
    replacement of SGLang's ``DecodeKVCacheOffloadManager`` and return ``True``; off,
    return ``False`` and import nothing.

    Raises (SGLang's loader logs the error, "Failed to execute general plugin: kvlife",
    and goes on with its own manager; nothing was registered):
        PluginSettingsError: a ``KVLIFE_*`` setting it cannot use.
        UnsupportedSGLangError: the switch is on and the installed SGLang is not one of
            ``TESTED_SGLANG``; the message names both.
    """
    settings = PluginSettings.from_env()
    if not settings.enabled:
        return False
    import sglang.version  # noqa: PLC0415  (only where the plugin is switched on)

    version = str(sglang.version.__version__)
    if version not in TESTED_SGLANG:
        raise UnsupportedSGLangError(
            f"kvlife's SGLang plugin was tested on SGLang {', '.join(TESTED_SGLANG)}, and "
            f"this is SGLang {version}: SGLang's own decode offload manager stays in place "
            f"(install sglang=={TESTED_SGLANG[-1]}, or unset {SWITCH})"
        )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: PLC0415

    from kvlife.offload.engines.sglang import ServerDecodeOffloadManager  # noqa: PLC0415

    HookRegistry.register(TARGET, ServerDecodeOffloadManager, HookType.REPLACE)
    logger.info(
        "kvlife: SGLang %s's DecodeKVCacheOffloadManager will be kvlife's (%s=1); audit logs in %s",
        version,
        SWITCH,
        settings.audit_dir.resolve(),
    )
    return True
