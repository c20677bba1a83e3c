"""benchmarks/realdata.py on tiny files the tests write: the IDX reader and the text split."""
import gzip
import struct

import pytest
import torch

import realdata


def write_idx(path, kind, shape, payload: bytes, compress=False):
    data = struct.pack(">HBB", 0, kind, len(shape)) + struct.pack(f">{len(shape)}I", *shape) + payload
    (gzip.open if compress else open)(path, "wb").write(data)


@pytest.mark.parametrize("compress", [False, True])
def test_read_idx_reads_unsigned_bytes_in_shape(tmp_path, compress):
    path = tmp_path / ("a.idx.gz" if compress else "a.idx")
    write_idx(path, 0x08, (2, 3), bytes([0, 1, 2, 253, 254, 255]), compress)
    assert torch.equal(realdata.read_idx(path), torch.tensor([[0, 1, 2], [253, 254, 255]], dtype=torch.uint8))


def test_read_idx_reads_big_endian_ints_and_floats(tmp_path):
    write_idx(tmp_path / "i", 0x0C, (2,), struct.pack(">2i", -2, 70000))
    write_idx(tmp_path / "f", 0x0D, (1, 1), struct.pack(">f", 1.5))
    assert realdata.read_idx(tmp_path / "i").tolist() == [-2, 70000]
    assert realdata.read_idx(tmp_path / "f").tolist() == [[1.5]]


@pytest.mark.parametrize("header, payload", [(b"\x01\x00\x08\x01", b""), (b"\x00\x00\x07\x01", b"")])
def test_read_idx_refuses_a_file_that_is_not_idx(tmp_path, header, payload):
    (tmp_path / "x").write_bytes(header + struct.pack(">I", 0) + payload)
    with pytest.raises(ValueError, match="not an IDX file"):
        realdata.read_idx(tmp_path / "x")


def test_read_idx_refuses_a_short_file(tmp_path):
    write_idx(tmp_path / "x", 0x08, (4,), bytes(3))
    with pytest.raises(ValueError, match="3 bytes of data for shape"):
        realdata.read_idx(tmp_path / "x")


def test_fashion_mnist_reads_the_four_files_and_normalizes(tmp_path):
    for prefix, n in (("train", 3), ("t10k", 2)):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", 0x08, (n, 28, 28), bytes(range(n)) * 784, True)
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", 0x08, (n,), bytes(range(n)), True)
    data = realdata.fashion_mnist(tmp_path)
    images, labels = data["train"]
    assert images.shape == (3, 1, 28, 28) and images.dtype == torch.float32 and labels.tolist() == [0, 1, 2]
    assert images[0, 0, 0, 0].item() == pytest.approx((0 - realdata.MEAN) / realdata.STD)
    assert data["test"][0].shape == (2, 1, 28, 28)


def test_missing_data_says_how_to_install_it(tmp_path):
    with pytest.raises(realdata.MissingData, match="apt-get install dataset-fashion-mnist"):
        realdata.fashion_mnist(tmp_path)
    with pytest.raises(realdata.MissingData, match="apt-get install fortunes"):
        realdata.text_files(tmp_path)


def test_text_files_skip_indexes_and_links(tmp_path):
    (tmp_path / "b").write_bytes(b"bee")
    (tmp_path / "a").write_bytes(b"ay")
    (tmp_path / "a.dat").write_bytes(b"index")
    (tmp_path / "a.u8").symlink_to(tmp_path / "a")
    assert realdata.text_files(tmp_path) == [b"ay", b"bee"]


def test_split_text_cuts_every_file_by_position():
    files = [bytes(range(10)), bytes(range(100, 120))]
    train, held_out = realdata.split_text(files, 0.1)
    assert train.tolist() == list(range(9)) + list(range(100, 118))
    assert held_out.tolist() == [9, 118, 119]
    assert train.dtype == held_out.dtype == torch.uint8
