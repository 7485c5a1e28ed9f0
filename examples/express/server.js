// An Express app deployed unchanged: the builder runs `npm ci`, the start script serves it on $PORT.
const express = require("express");

const app = express();
app.get("/", (req, res) => res.send(`hello from express on ${process.env.ZATTERA_NODE_ID || "my machine"}\n`));
app.get("/healthz", (req, res) => res.send("ok\n"));
app.listen(Number(process.env.PORT || 3000), "0.0.0.0");
