#!/usr/bin/env bash
# Rebuild the prebuilt JupyterLab extension (jupyter/labextensions/slicebroker-lab/) from js/.
#
# Needs Node.js 18+ and npm, and JupyterLab in the Python environment ($PYTHON, default
# python): the bundle shares JupyterLab's own packages at the versions of its staging
# folder. The result is committed, so that installing the package needs neither; run
# this after changing js/ and commit jupyter/labextensions/ with the change.
set -euo pipefail
cd "$(dirname "$0")/js"
npm ci --no-audit --no-fund
rm -rf lib ../jupyter/labextensions tsconfig.tsbuildinfo
npx tsc
core=$("${PYTHON:-python}" -c 'import jupyterlab, os; print(os.path.join(os.path.dirname(jupyterlab.__file__), "staging"))')
npx build-labextension --core-path "$core" .
