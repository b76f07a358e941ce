# Sourced by the device scripts (gpu_check.sh, gpu_probe.sh, gpu_niah.sh), from the repository root: installs
# the carried wheels (.whl/, tools/fetch_gpu_wheels.sh) whose module the device image lacks into /tmp/site and
# sets PYTHONPATH (/tmp/site when it installed anything, and the repository). Returns non-zero when pip fails.
PY=${PY:-python3}
export PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
    missing=()
    for wheel in .whl/*.whl; do
        dist=$(basename "$wheel" | sed 's/-[0-9].*//' | tr 'A-Z' 'a-z')
        case "$dist" in
            pyyaml) module=yaml ;;
            *) module=${dist//-/_} ;;
        esac
        if ! "$PY" -c "import $module" 2>/dev/null; then missing+=("$wheel"); fi
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "installing: ${missing[*]}"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "${missing[@]}" || return 1
        export PYTHONPATH=/tmp/site:$PWD
    else
        echo "every carried package is already there"
    fi
else
    echo "no .whl/ carried (run tools/fetch_gpu_wheels.sh and carry .whl); code that needs gguf will fail to import"
fi
