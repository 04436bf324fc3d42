"""The first module the library's fork server preloads: the server dies with the process that started it
(``PR_SET_PDEATHSIG``), even one killed by SIGKILL while the server still imports the other modules, and its children
(which die with the server) with it.

It acts only in that server: ``interop.sampling.child_processes`` starts the server with
``interop.sampling._child.FORK_SERVER_STARTER`` naming the starting process in its environment; imported anywhere
else (a test collecting every module), it does nothing.

Dependencies: the standard library.
"""

import os

from interop.sampling._child import FORK_SERVER_STARTER, die_with_parent

if os.environ.get(FORK_SERVER_STARTER) == str(os.getppid()):
    _starter = int(os.environ.pop(FORK_SERVER_STARTER))
    die_with_parent()
    if os.getppid() != _starter:  # the starter died before the signal was set: it never will be sent
        os._exit(1)
