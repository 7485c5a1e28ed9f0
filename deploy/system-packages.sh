#!/usr/bin/env bash
# Installs the Debian packages named as arguments when they are missing: with apt-get when running as root
# (CI does), otherwise it prints the exact command and fails, so nothing runs half-equipped.
set -euo pipefail
missing=()
for package in "$@"; do
  # Installed as a Debian package, or its command is there from elsewhere (e.g. npm bundled with NodeSource's nodejs).
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" && continue
  command -v "$package" >/dev/null 2>&1 && continue
  missing+=("$package")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "zattera needs these Debian packages: ${missing[*]}" >&2
  echo "install them with: sudo apt-get install -y --no-install-recommends ${missing[*]}" >&2
  exit 1
fi
echo "installing Debian packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
