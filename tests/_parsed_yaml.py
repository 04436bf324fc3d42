"""Each YAML text parsed once per test process: ``OmegaConf.load`` (what Hydra reads every config file of ``conf/``
with, at every compose, and what a resume reads ``resolved_config.yaml`` with) keeps the config built from each text.

Hydra parses the ~14 files of a recipe's config again at every compose: PyYAML's pure-Python scanner and OmegaConf's
node building take 0.05 s of a compose's 0.14 s, a copy of a config built once 0.006 s; most tests compose a config
(a test's ``compose_config``, every recipe command line run in the test's process). The cache is keyed by the text
itself, not by the file's path or time: a test that rewrites a config file, however fast, has its new text parsed.
Each call gets a config of its own (a deep copy of the one built from that text), as ``OmegaConf.load`` gives one.
"""

from __future__ import annotations

import copy
import io
import os
import pathlib

from omegaconf import DictConfig, ListConfig, OmegaConf


def parse_each_yaml_text_once() -> None:
    """Replaces ``OmegaConf.load`` in this process by a load that parses each distinct text once (idempotent)."""
    if getattr(OmegaConf.load, "_parses_each_text_once", False):
        return
    load = OmegaConf.load
    parsed: dict[str, DictConfig | ListConfig] = {}

    def load_parsed_once(file_):
        if isinstance(file_, (str, pathlib.Path)):
            name = os.path.abspath(file_)
            with open(name, encoding="utf-8") as handle:
                text = handle.read()
        elif getattr(file_, "read", None):
            name, text = getattr(file_, "name", None), file_.read()
        else:
            return load(file_)  # OmegaConf's own TypeError
        if text not in parsed:
            stream = io.StringIO(text)
            if name is not None:
                stream.name = name  # PyYAML's error marks name the file, as when it reads the file itself
            parsed[text] = load(stream)
        return copy.deepcopy(parsed[text])

    load_parsed_once._parses_each_text_once = True  # type: ignore[attr-defined]
    OmegaConf.load = staticmethod(load_parsed_once)  # type: ignore[method-assign]
