"""Stand-in for slime/utils/http_utils.py @624b824, which imports httpx at the top (http_utils.py:10; httpx is not
installed here). slime/utils/misc.py:10 imports ``is_port_available`` from it at module level (misc.py is real in
this tier: its ``load_function`` loads lossguard's hooks); nothing on the training path calls it. This one answers
the same question (can a TCP port be bound on every interface?) with the standard library."""
import socket


def is_port_available(port):
    """Whether ``port`` can be bound (http_utils.py:28 @624b824 asks the same; not called by the tier)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except (OSError, OverflowError):
            return False
        return True
