"""Offline install bundles (``healsweep bundle``): exactly the wheels a target machine lacks to run healsweep,
computed from its Python version and ``pip freeze``, slimmed, packed into one ``tar.xz`` with a stdlib-only
installer (``install.py``) that installs them with no package index. docs/offline-install.md has the commands.

- ``resolve``: the missing set (requirement walk with the target's markers; pure, fetcher injected)
- ``fetch``: ``pip download`` for the target's tags; healsweep's own wheel from the checkout
- ``slim``: strip debug sections, drop Ray's jars and web client, store uncompressed, rewrite RECORD
- ``pack``: manifest and archive; ``build``: all of it; ``install``: the installer shipped in the bundle
"""
