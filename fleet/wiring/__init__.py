"""The fleet's processes (as app/ wires the sidecar's): settings, the HTTP listener, one event loop.

directory.py  `kvdepot directory`: DirectorySettings, DirectoryService (build, run, stop)
route.py      `kvdepot route`: RouterSettings from the file and flags, the router's server

Only the command line (app/cli.py), the benchmarks and the tests import these.
"""
