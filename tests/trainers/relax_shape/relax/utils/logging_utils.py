"""Stand-in for relax.utils.logging_utils.get_logger (redai-studio/Relax relax/utils/logging_utils.py @b71db72):
a standard logger by name, without Relax's handlers."""
import logging


def get_logger(name):
    return logging.getLogger(name)
