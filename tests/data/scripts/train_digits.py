"""Train a small CNN on digit images: a training script written the way course and example
scripts are (argparse, a Net class, train() and test() functions, main() building the data,
model and optimizer, a StepLR schedule, an optional checkpoint at the end).

The images are made up (28x28, ten classes) so nothing is downloaded; each item is loaded
as an image library's decoder would hand it over (uint8 pixels to a normalised float
tensor), after `--read-latency-ms` of waiting, as reading it from slow storage costs.
"""

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn, optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, Dataset

MEAN, STD = 0.1307, 0.3081


class DigitImages(Dataset):
    """`size` random 28x28 grey images with labels 0-9, decoded one at a time."""

    def __init__(self, size, seed, read_latency_s=0.0):
        generator = torch.Generator().manual_seed(seed)
        self.pixels = torch.randint(0, 256, (size, 28, 28), dtype=torch.uint8, generator=generator)
        self.labels = torch.randint(0, 10, (size,), generator=generator)
        self.read_latency_s = read_latency_s

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        if self.read_latency_s:
            time.sleep(self.read_latency_s)  # the storage read
        decoded = np.asarray(self.pixels[index].numpy(), dtype=np.uint8)
        image = torch.from_numpy(decoded.copy()).unsqueeze(0).float().div(255)
        return (image - MEAN) / STD, int(self.labels[index])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3)
        self.bn2 = nn.BatchNorm2d(32)
        self.dropout = nn.Dropout(0.25)
        self.fc1 = nn.Linear(32 * 12 * 12, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.max_pool2d(x, 2)
        x = self.dropout(torch.flatten(x, 1))
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def train(args, model, loader, optimizer, epoch):
    model.train()
    for batch, (images, labels) in enumerate(loader):
        optimizer.zero_grad()
        loss = F.nll_loss(model(images), labels)
        loss.backward()
        optimizer.step()
        if batch % args.log_interval == 0:
            seen = batch * len(images)
            print(
                f"Train Epoch: {epoch} [{seen}/{len(loader.dataset)} "
                f"({100.0 * batch / len(loader):.0f}%)]\tLoss: {loss.item():.6f}"
            )
            if args.dry_run:
                break


def test(model, loader):
    model.eval()
    total_loss, correct = 0.0, 0
    with torch.no_grad():
        for images, labels in loader:
            output = model(images)
            total_loss += F.nll_loss(output, labels, reduction="sum").item()
            correct += (output.argmax(dim=1) == labels).sum().item()
    count = len(loader.dataset)
    print(
        f"\nTest set: Average loss: {total_loss / count:.4f}, "
        f"Accuracy: {correct}/{count} ({100.0 * correct / count:.0f}%)\n"
    )


def main():
    parser = argparse.ArgumentParser(description="Train a small CNN on digit images")
    parser.add_argument("--batch-size", type=int, default=64, help="training batch size")
    parser.add_argument("--test-batch-size", type=int, default=1000, help="test batch size")
    parser.add_argument("--epochs", type=int, default=3, help="epochs to train")
    parser.add_argument("--lr", type=float, default=1.0, help="learning rate")
    parser.add_argument("--gamma", type=float, default=0.7, help="learning rate decay a step")
    parser.add_argument("--seed", type=int, default=1, help="random seed")
    parser.add_argument("--log-interval", type=int, default=10, help="batches between logs")
    parser.add_argument("--dry-run", action="store_true", help="one batch an epoch")
    parser.add_argument("--save-model", action="store_true", help="save the trained model")
    parser.add_argument("--train-size", type=int, default=6000, help="training images")
    parser.add_argument("--test-size", type=int, default=1000, help="test images")
    parser.add_argument("--read-latency-ms", type=float, default=0.0, help="wait per item read")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    latency_s = args.read_latency_ms / 1000
    train_loader = DataLoader(
        DigitImages(args.train_size, seed=1, read_latency_s=latency_s),
        batch_size=args.batch_size,
        shuffle=True,
    )
    test_loader = DataLoader(
        DigitImages(args.test_size, seed=2, read_latency_s=latency_s),
        batch_size=args.test_batch_size,
    )

    model = Net()
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        train(args, model, train_loader, optimizer, epoch)
        test(model, test_loader)
        scheduler.step()

    if args.save_model:
        torch.save(model.state_dict(), "digits_cnn.pt")


if __name__ == "__main__":
    main()
