#!/usr/bin/env bash
# tests/integration/test_disk_faults.sh: the disk rows of `make reliability`
# in `make test` (a few seconds): EIO on every expert read from a loop-device
# drive shrunk under its mount, and a full file system under the usage
# history and a repack's output. The checks and their ok / not ok / skip
# lines are tests/reliability/row_disk.sh's (root; a skip line otherwise).
exec bash "$(dirname "$0")/../reliability/row_disk.sh"
