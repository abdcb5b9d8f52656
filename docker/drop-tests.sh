#!/bin/sh
# Deletes the test suites that wheels ship into the image's site-packages (torch's C++ test binaries; the `tests`
# packages of pandas, numpy, sympy, networkx, pyarrow...): ~200 MB that no service imports. Run by the Dockerfile
# in the same layer as the install, so the files never reach the image.
set -eu
site=$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
rm -rf "$site/torch/test" "$site"/torch/bin/test_*
find "$site" -depth -type d -name tests -exec rm -rf {} +
