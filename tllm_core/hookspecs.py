"""pluggy hook specifications of the ``tllm`` plugin system.

A plugin is any module or object with functions marked ``@hookimpl``; third-party
plugins are found through the entry-point group ``tllm``::

    # pyproject.toml of your package
    [project.entry-points.tllm]
    my_plugin = "my_package.plugin"
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("tllm")
hookimpl = pluggy.HookimplMarker("tllm")


@hookspec
def tllm_consumers() -> list[type]:
    """Return the :class:`~tllm_core.consumer.Consumer` subclasses this plugin provides.

    Example::

        from tllm_core import Consumer, hookimpl

        class Echo(Consumer):
            name = "echo"
            description = "Counts decode rows."

        @hookimpl
        def tllm_consumers():
            return [Echo]
    """
