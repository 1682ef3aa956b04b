"""The ClientApp: load the global model, train on this SuperNode's own data, reply with the new weights."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from plain_flower.task import build_model, load_partition, train, widths

app = ClientApp()


@app.train()
def train_step(msg: Message, context: Context) -> Message:
    cfg = context.run_config
    torch.set_num_threads(int(cfg["torch-threads"]))
    x, y = load_partition(str(context.node_config["data-path"]))
    net = build_model(int(cfg["in-features"]), widths(cfg["hidden"]), int(cfg["num-classes"]))
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    server_round = int(msg.content["config"]["server-round"])
    partition = int(context.node_config["partition-id"])
    generator = torch.Generator().manual_seed(int(cfg["seed"]) * 1_000_003 + partition * 1_009 + server_round)
    loss = train(net, x, y, epochs=int(cfg["local-epochs"]), batch_size=int(cfg["batch-size"]), lr=float(cfg["lr"]),
                 momentum=float(cfg["momentum"]), generator=generator)
    # FedAvg weighs by record counts; DP-FedAvg weighs every client alike (its sensitivity assumes it)
    weight = 1.0 if bool(cfg["dp"]) else float(len(x))
    content = RecordDict({"arrays": ArrayRecord(net.state_dict()),
                          "metrics": MetricRecord({"train-loss": loss, "num-examples": len(x), "weight": weight})})
    return Message(content=content, reply_to=msg)
