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

The HiCache lens (``kvlife.offload.watch.sglang``) has its own switch, independent of
the one above::

    KVLIFE_SGLANG_HICACHE=observe python -m sglang.launch_server ... --enable-hierarchical-cache

* ``KVLIFE_SGLANG_HICACHE``: ``observe`` (write verdicts down, change nothing), ``refuse``
  (also take out of an ack the node ids no pending copy explains, so a duplicate ack no
  longer kills the scheduler), or ``off``/unset. With it on, an SGLang hook runs after
  every ``UnifiedRadixCache.init_hicache`` and puts the lens on that cache; each scheduler
  process writes ``DIR/sglang-hicache-RANK.jsonl`` (``KVLIFE_AUDIT_DIR``,
  ``KVLIFE_AUDIT_FLUSH_S`` as above).
* ``KVLIFE_AUDIT_OVERDUE_S``: seconds a copy may stay in flight before it is written down
  as ``overdue`` (default 120).

This module imports nothing from SGLang or torch until a switch is on, so a process in
which both are off pays two environment lookups.
"""

from __future__ import annotations

import functools
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
HICACHE_SWITCH = "KVLIFE_SGLANG_HICACHE"
AUDIT_OVERDUE_S = "KVLIFE_AUDIT_OVERDUE_S"
#: Where the HiCache lens goes on: after this method of SGLang 0.5.23's cache.
HICACHE_TARGET = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.init_hicache"
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
    #: The HiCache lens's mode (``observe`` or ``refuse``), or ``None``: no lens.
    hicache: str | None = None
    overdue_s: float = 120.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PluginSettings:
        """The settings in ``environ`` (default ``os.environ``).

        Raises:
            PluginSettingsError: a switch value that is neither on nor off (nor observe or
                refuse for the HiCache lens), or a flush interval or overdue limit that is
                not a positive number; the message names the variable and the value.
        """
        env = os.environ if environ is None else environ
        raw = env.get(SWITCH, "").strip().lower()
        if raw not in _ON | _OFF:
            raise PluginSettingsError(
                f"{SWITCH}={env[SWITCH]!r}: use 1 (kvlife's decode offload manager) or 0 "
                "(SGLang's own)"
            )
        flush = _seconds(env, AUDIT_FLUSH_S, "1.0", "seconds between fsyncs")
        audit_dir = Path(env.get(AUDIT_DIR) or "kvlife-audit")
        lens = env.get(HICACHE_SWITCH, "").strip().lower()
        if lens not in ("observe", "refuse") and lens not in _OFF:
            raise PluginSettingsError(
                f"{HICACHE_SWITCH}={env[HICACHE_SWITCH]!r}: use observe, refuse or off"
            )
        overdue = _seconds(env, AUDIT_OVERDUE_S, "120", "seconds a copy may stay in flight")
        return cls(
            enabled=raw in _ON,
            audit_dir=audit_dir,
            flush_interval_s=flush,
            hicache=lens if lens in ("observe", "refuse") else None,
            overdue_s=overdue,
        )


def _seconds(env: Mapping[str, str], name: str, default: str, meaning: str) -> float:
    """The positive, finite number of seconds ``env[name]`` says (``default`` if unset).

    Raises:
        PluginSettingsError: anything else; the message names the variable and the value.
    """
    raw = env.get(name, default)
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise PluginSettingsError(f"{name}={raw!r}: {meaning}, a positive number")
    return value


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


def hicache_log_path(settings: PluginSettings, rank: str) -> Path:
    """The HiCache lens's log of the scheduler process named ``rank``:
    ``DIR/sglang-hicache-RANK.jsonl``."""
    return settings.audit_dir / f"sglang-hicache-{rank}.jsonl"


def lens_after_init_hicache(
    settings: PluginSettings, result: object, cache: object, *args: object, **kwargs: object
) -> None:
    """SGLang's AFTER hook on ``UnifiedRadixCache.init_hicache`` (``settings`` bound by
    ``register``): put the HiCache lens on the cache just initialised. A cache the lens
    cannot read runs without it, and the server's log says why (``NoLensError``)."""
    from sglang.srt.runtime_context import get_parallel  # noqa: PLC0415

    from kvlife.offload.watch.sglang import HiCacheLens, NoLensError, attach  # noqa: PLC0415

    if settings.hicache is None:
        return
    try:
        parallel = get_parallel()
        rank = rank_name(
            parallel.tp_rank, parallel.pp_rank, parallel.pp_size, getattr(parallel, "dp_rank", None)
        )
    except Exception:  # no parallel state published (a cache built outside a scheduler)
        rank = "tp0"
    path = hicache_log_path(settings, rank)
    try:
        attach(
            cache,
            HiCacheLens(
                path,
                f"SGLang {type(cache).__qualname__} ({rank})",
                mode=settings.hicache,
                overdue_s=settings.overdue_s,
                flush_interval_s=settings.flush_interval_s,
            ),
        )
    except NoLensError as exc:
        logger.warning("%s", exc)
        return
    logger.info("kvlife: HiCache lens on (%s), audit log %s", settings.hicache, path.resolve())


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
    if not settings.enabled and settings.hicache is None:
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

    if settings.hicache is not None:
        hook = functools.partial(lens_after_init_hicache, settings)
        HookRegistry.register(HICACHE_TARGET, hook, HookType.AFTER)
        logger.info(
            "kvlife: SGLang %s's HiCache will have kvlife's lens (%s)", version, settings.hicache
        )
        if not settings.enabled:
            return True
    from kvlife.offload.engines.sglang import ServerDecodeOffloadManager  # noqa: PLC0415

    HookRegistry.register(TARGET, ServerDecodeOffloadManager, HookType.REPLACE)
    logger.info(
        "kvlife: SGLang %s's DecodeKVCacheOffloadManager will be kvlife's (%s=1); audit logs in %s",
        version,
        SWITCH,
        settings.audit_dir.resolve(),
    )
    return True
