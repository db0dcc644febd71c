//! The declared shape of an IDX images file, read from its header alone, and the files of an
//! MNIST-layout directory, which the loaders and a memory check both use.

mod common;

use std::path::Path;

use common::{gzip, idx_bytes, write, TempDir};
use lockstep_data::{
    idx_files, idx_images_shape, load_fashion_mnist, load_idx_split, read_idx, DataError, IdxFiles,
    IdxShape, IdxSplit, IDX_IMAGES_U8, IDX_LABELS_U8, IDX_MAX_PAYLOAD_BYTES,
};

fn shape(count: usize, rows: usize, cols: usize) -> IdxShape {
    IdxShape { count, rows, cols }
}

#[test]
fn shape_of_gzip_and_raw_files_is_the_header_and_agrees_with_the_loader() {
    let dir = TempDir::new("shape");
    let raw = idx_bytes(IDX_IMAGES_U8, &[3, 2, 4], &[5; 24]);
    let (gz, plain) = (dir.path("img.gz"), dir.path("img"));
    write(&gz, &gzip(&raw));
    write(&plain, &raw);
    for p in [&gz, &plain] {
        let s = idx_images_shape(p).unwrap();
        assert_eq!(s, shape(3, 2, 4));
        assert_eq!(s.pixels(), 24);
        let arr = read_idx(p, IDX_IMAGES_U8, "u8 images").unwrap();
        assert_eq!(arr.dims, [s.count, s.rows, s.cols]);
    }
}

/// 2048×2048 images, the case lockstep-train's memory check missed: the header says so, and
/// only the header is read. The payload here is not even valid gzip (a first gzip member holds
/// the header, then garbage): the shape is read, and the loader refuses the file.
#[test]
fn shape_reads_only_the_header() {
    let dir = TempDir::new("shape-header-only");
    let p = dir.path("train-images-idx3-ubyte.gz");
    let mut bytes = gzip(&idx_bytes(IDX_IMAGES_U8, &[200, 2048, 2048], &[]));
    bytes.extend_from_slice(b"this is not a gzip member");
    write(&p, &bytes);
    let s = idx_images_shape(&p).unwrap();
    assert_eq!(s, shape(200, 2048, 2048));
    assert_eq!(s.pixels(), 200 * 2048 * 2048);
    let err = read_idx(&p, IDX_IMAGES_U8, "u8 images").unwrap_err();
    assert!(matches!(err, DataError::Gzip { .. }), "{err:?}");
}

/// The header checks are the loader's, with the same errors.
#[test]
fn shape_refuses_what_the_loader_refuses_from_the_header() {
    let dir = TempDir::new("shape-errors");
    let same = |p: &Path| {
        let a = idx_images_shape(p).unwrap_err().to_string();
        let b = read_idx(p, IDX_IMAGES_U8, "u8 images")
            .unwrap_err()
            .to_string();
        assert_eq!(a, b);
        a
    };

    // Over the cap: 300 images of 2048×2048 are 1.2 GiB.
    let p = dir.path("huge.gz");
    write(
        &p,
        &gzip(&idx_bytes(IDX_IMAGES_U8, &[300, 2048, 2048], &[0; 64])),
    );
    assert!(matches!(
        idx_images_shape(&p),
        Err(DataError::IdxTooLarge { .. })
    ));
    assert_eq!(
        same(&p),
        format!(
            "{}: header declares 300×2048×2048 = 1258291200 bytes of u8 images, more than the \
             limit of {IDX_MAX_PAYLOAD_BYTES} bytes",
            p.display()
        )
    );

    // A labels file.
    let p = dir.path("labels");
    write(&p, &idx_bytes(IDX_LABELS_U8, &[2], &[0, 1]));
    assert!(matches!(
        idx_images_shape(&p),
        Err(DataError::IdxMagic { .. })
    ));
    same(&p);

    // A header cut short.
    let p = dir.path("short");
    write(&p, &idx_bytes(IDX_IMAGES_U8, &[2, 28, 28], &[])[..10]);
    assert!(same(&p).contains("truncated: the header of 3 dimension(s) takes 16 bytes"));

    // Missing, and not a regular file.
    same(&dir.path("missing"));
    assert!(matches!(
        idx_images_shape(&dir.path("missing")),
        Err(DataError::NotFound { .. })
    ));
    if Path::new("/dev/zero").exists() {
        assert!(matches!(
            idx_images_shape(Path::new("/dev/zero")),
            Err(DataError::NotRegularFile { .. })
        ));
    }
}

/// `.gz` when it exists, else the plain name, per file; the loaders open exactly these.
#[test]
fn idx_files_are_the_files_the_loaders_open() {
    let dir = TempDir::new("idx-files");
    let root = dir.path("");
    let img = |n: u32| idx_bytes(IDX_IMAGES_U8, &[n, 2, 2], &vec![9; 4 * n as usize]);
    let lab = |n: u32| idx_bytes(IDX_LABELS_U8, &[n], &vec![1; n as usize]);
    // Train as installed (gzip), test gunzipped.
    write(&dir.path("train-images-idx3-ubyte.gz"), &gzip(&img(3)));
    write(&dir.path("train-labels-idx1-ubyte.gz"), &gzip(&lab(3)));
    write(&dir.path("t10k-images-idx3-ubyte"), &img(2));
    write(&dir.path("t10k-labels-idx1-ubyte"), &lab(2));

    let train = idx_files(&root, IdxSplit::Train);
    assert_eq!(
        train,
        IdxFiles {
            images: dir.path("train-images-idx3-ubyte.gz"),
            labels: dir.path("train-labels-idx1-ubyte.gz"),
        }
    );
    let test = idx_files(&root, IdxSplit::Test);
    assert_eq!(
        test,
        IdxFiles {
            images: dir.path("t10k-images-idx3-ubyte"),
            labels: dir.path("t10k-labels-idx1-ubyte"),
        }
    );
    assert_eq!(idx_images_shape(&train.images).unwrap(), shape(3, 2, 2));
    assert_eq!(idx_images_shape(&test.images).unwrap(), shape(2, 2, 2));

    let ds = load_idx_split(&root, IdxSplit::Train, "x").unwrap();
    assert_eq!((ds.name.as_str(), ds.len(), ds.shape), ("x", 3, [1, 2, 2]));
    let (tr, te) = load_fashion_mnist(&root).unwrap();
    assert_eq!(
        (tr.name.as_str(), tr.len(), te.name.as_str(), te.len()),
        ("fashion-mnist-train", 3, "fashion-mnist-test", 2)
    );

    // Neither file: the plain name, which the loader reports missing.
    let empty = TempDir::new("idx-files-empty");
    let files = idx_files(&empty.path(""), IdxSplit::Train);
    assert_eq!(files.images, empty.path("train-images-idx3-ubyte"));
    let err = load_idx_split(&empty.path(""), IdxSplit::Train, "x").unwrap_err();
    assert!(
        matches!(err, DataError::NotFound { ref path, .. } if *path == files.images),
        "{err:?}"
    );
}
