"""A standard Flask app, deployed unchanged: the builder installs requirements.txt and runs the Procfile."""

import os

from flask import Flask

app = Flask(__name__)


@app.get("/")
def index() -> str:
    return f"hello from flask on {os.environ.get('ZATTERA_NODE_ID', 'my machine')}\n"


@app.get("/healthz")
def healthz() -> str:
    return "ok\n"
