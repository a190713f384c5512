"""The first Ctrl-C's road (preemption.py) where Lightning holds no SIGTERM handler: the
KeyboardInterrupt of a plain Ctrl-C, nothing sent, and SIGINT's handler as it was after."""
import os
import signal

import pytest

from lst_lightning.app.preemption import exit_on_preemption


def test_a_ctrl_c_while_lightning_handles_no_sigterm_is_a_keyboard_interrupt(tmp_path):
    before_int, before_term = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # no fit or test running: the default would end the process
    try:
        with pytest.raises(KeyboardInterrupt), exit_on_preemption(tmp_path):
            assert signal.getsignal(signal.SIGINT) is not before_int
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is before_int
    finally:
        signal.signal(signal.SIGTERM, before_term)
