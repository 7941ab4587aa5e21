"""``python -m pipeflow.config schedules``: the registered schedules as a markdown table."""

import sys

from .command_line import schedule_table

if __name__ == "__main__":
    if sys.argv[1:] != ["schedules"]:
        sys.exit("usage: python -m pipeflow.config schedules")
    print(schedule_table())
