"""What every ``atp-router`` command line shares, whichever package implements the
command (the router, ``policy check``, ``audit``, ``eval``, ``model-server``):
:mod:`~atp_router.cliutil.helpfmt`, the ``--help`` formatter. Imports no other ``atp``
package, so any layer's command can use it.
"""
