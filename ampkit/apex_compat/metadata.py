"""The stand-in's package metadata: while it is installed, ``importlib.metadata`` finds a
distribution named ``apex`` (version ``0.1+ampkit.<ampkit version>``) in this process only,
as libraries that look for Apex by its metadata expect (Hugging Face transformers'
``is_apex_available()``). Nothing is written to disk; it lists no files."""
import importlib.metadata
import pathlib
import re

from .. import __version__ as _ampkit_version

VERSION = "0.1+ampkit." + re.sub(r"[^a-z0-9]+", ".", _ampkit_version.lower()).strip(".")  # PEP 440 local version
_TEXTS = {
    "METADATA": ("Metadata-Version: 2.1\nName: apex\nVersion: " + VERSION + "\n"
                 "Summary: ampkit standing in for NVIDIA Apex in this process only (python -m ampkit.apex_compat); "
                 "not an installed package\n"),
    "top_level.txt": "amp_C\napex\n",  # read by importlib.metadata.packages_distributions()
}


class StandInDistribution(importlib.metadata.Distribution):
    """The ``apex`` distribution record of ampkit's stand-in."""

    def read_text(self, filename):
        return _TEXTS.get(filename)

    def locate_file(self, path):
        return pathlib.Path(__file__).parent / path  # where the stand-in lives; it lists no files


def find_distributions(context) -> list:
    """The stand-in's record when ``context`` asks for ``apex`` (or for every distribution) on
    the import path; nothing for a search of explicit paths, where no stand-in lies."""
    if "path" in vars(context):
        return []
    if context.name is not None and re.sub(r"[-_.]+", "-", context.name).lower() != "apex":
        return []
    return [StandInDistribution()]
