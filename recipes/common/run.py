"""What every recipe's entry point does around its training, so that a run's folder says how the run went.

Hydra writes the job's log to ``<run folder>/<recipe>.log`` (and the console) from Python's logging; an exception it
would only print. :func:`run_recipe` puts warnings and errors in that log too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from omegaconf import DictConfig

from recipes.common.config import ConfigError

__all__ = ["run_recipe"]

log = logging.getLogger(__name__)


def run_recipe(train: Callable[[DictConfig], dict], cfg: DictConfig) -> dict:
    """Runs ``train(cfg)`` and returns its summary; on failure, logs why and exits with status 1.

    A :class:`ConfigError` (bad settings or data, raised before the expensive work) is logged as its message alone:
    the message names the setting and the fix, and a traceback would only bury it. Any other error is logged with its
    traceback. Python warnings go to the log as well.
    """
    logging.captureWarnings(True)
    try:
        return train(cfg)
    except ConfigError as error:
        log.error("%s", error)
    except Exception:
        log.exception("The run failed; the traceback follows.")
    raise SystemExit(1)
